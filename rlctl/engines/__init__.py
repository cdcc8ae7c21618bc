"""Training engines: :func:`build_engine` gives the one the spec's ``backend`` names.

Both engines take the same arguments and implement :class:`rlctl.engines.base.TrainEngine`, so the
recipes never branch on the backend. What to build is an :class:`rlctl.engines.spec.EngineSpec`
(``EngineSpec.from_config(cfg)`` of the resolved run config, with the optimizer and LoRA specs); the
engines never read the run config. The engine modules are imported on
demand (the Megatron one needs megatron-core).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlctl.engines.spec import BACKENDS, EngineSpec, LoraSpec, OptimizerSpec

if TYPE_CHECKING:
    from rlctl.engines.base import ModelSource, TrainEngine

__all__ = ["BACKENDS", "EngineSpec", "LoraSpec", "OptimizerSpec", "build_engine"]


def build_engine(
    spec: EngineSpec,
    *,
    role: str,
    trainable: bool = True,
    total_steps: int = 0,
    source: ModelSource | None = None,
) -> TrainEngine:
    """The engine for ``spec.backend``: :class:`rlctl.engines.fsdp.FSDPEngine` or
    :class:`rlctl.engines.megatron.engine.MegatronEngine` (role "actor" / "ref" / "critic", ``trainable``,
    ``total_steps`` of the lr schedule, weight ``source``; everything else is in the spec)."""
    if spec.backend == "megatron":
        from rlctl.engines.megatron.engine import MegatronEngine as engine_class
    else:
        from rlctl.engines.fsdp import FSDPEngine as engine_class
    return engine_class(spec, role=role, trainable=trainable, total_steps=total_steps, source=source)
