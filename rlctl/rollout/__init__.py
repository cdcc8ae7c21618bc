"""Rollout engines behind one small interface: ``make_rollout_engine(name, model_path, ...)``.

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

__all__ = ["RolloutEngine", "Sample", "SamplingParams", "make_rollout_engine"]
