"""Rollout engines behind one small interface: ``make_rollout_engine(RolloutSpec(...))``.

Engines: "hf" (plain transformers, our own decoding loop), "vllm" (in-process ``vllm.LLM``) and
"sglang" (in-process ``sglang.Engine``). See :mod:`rlctl.rollout.base` for the interface and the
log-probability convention, and docs/rollout.md.
"""

from rlctl.rollout.base import (
    RolloutEngine,
    Sample,
    SamplingParams,
    make_rollout_engine,
)
from rlctl.rollout.spec import RolloutSpec

__all__ = ["RolloutEngine", "RolloutSpec", "Sample", "SamplingParams", "make_rollout_engine"]
