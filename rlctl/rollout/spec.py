"""What a rollout engine is asked to build: :class:`RolloutSpec`, one typed record instead of keyword
arguments repeated by every engine.

:meth:`RolloutSpec.from_config` reads the resolved run config once (engine, tp, memory share, length
budget, seed); the trainer then sets what only a rank knows (:meth:`RolloutSpec.replace`): the weights'
directory, its device, the dtype of its actor and its own seed. :func:`rlctl.rollout.make_rollout_engine`
checks the spec and builds the engine it names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlctl.config import RunConfig


@dataclass(frozen=True)
class RolloutSpec:
    """How to build a rollout engine.

    ``mem_fraction`` is the share of accelerator memory the engine may take (vLLM's
    ``gpu_memory_utilization``, SGLang's ``mem_fraction_static``; ignored by "hf"); ``max_model_len``
    bounds prompt + response length.
    """

    engine: str = "hf"  # hf | vllm | sglang
    model_path: str = ""  # an HF model directory (or hub id)
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "float32"  # float32 | bfloat16 | float16 (or fp32 | bf16 | fp16)
    tp: int = 1
    mem_fraction: float = 0.5
    max_model_len: int = 0
    seed: int = 0
    enable_prefix_caching: bool = True

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RolloutSpec:
        """The settings of ``rollout.*`` in a resolved config (0 / None the plan left: the defaults);
        ``seed`` is ``train.seed`` (each rank adds its rank)."""
        r = cfg.rollout
        return cls(
            engine=r.engine or "hf",  # None: the plan chose none
            tp=r.tp or 1,
            mem_fraction=r.mem_fraction or 0.5,
            max_model_len=r.max_prompt_len + r.max_response_len,
            seed=cfg.train.seed,
        )

    def replace(self, **changes) -> RolloutSpec:
        return dataclasses.replace(self, **changes)
