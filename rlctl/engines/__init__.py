"""Training engines: :func:`build_engine` gives the one the spec's ``backend`` names.

Both engines take the same arguments and implement :class:`rlctl.engines.base.TrainEngine`, so the
recipes never branch on the backend. What to build is an :class:`rlctl.engines.spec.EngineSpec`
(``EngineSpec.from_config(cfg)`` of the resolved run config). The engine modules are imported on
demand (the Megatron one needs megatron-core).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlctl.engines.spec import BACKENDS, EngineSpec

if TYPE_CHECKING:
    from rlctl.config import RunConfig
    from rlctl.engines.base import ModelSource, TrainEngine

__all__ = ["BACKENDS", "EngineSpec", "build_engine"]


def build_engine(
    spec: EngineSpec,
    cfg: RunConfig,
    *,
    role: str,
    trainable: bool = True,
    total_steps: int = 0,
    lr: float | None = None,
    source: ModelSource | None = None,
    lora: bool | None = None,
) -> TrainEngine:
    """The engine for ``spec.backend`` ("fsdp" or "megatron").

    Args: see :class:`rlctl.engines.fsdp.FSDPEngine` (role "actor" / "ref" / "critic", ``trainable``,
    ``total_steps`` of the lr schedule, peak ``lr``, weight ``source``, ``lora``).
    """
    kwargs = {
        "role": role,
        "trainable": trainable,
        "total_steps": total_steps,
        "lr": lr,
        "source": source,
        "lora": lora,
    }
    if spec.backend == "megatron":
        from rlctl.engines import megatron

        return megatron.build_engine(spec, cfg, **kwargs)
    from rlctl.engines.fsdp import FSDPEngine

    return FSDPEngine(spec, cfg, **kwargs)
