"""Training engines: :func:`build_engine` gives the one the plan's ``backend`` names.

Both engines take the same arguments and implement :class:`rlctl.engines.base.TrainEngine`, so the
recipes never branch on the backend. The engine modules are imported on demand (the Megatron one
needs megatron-core).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from rlctl.errors import UserError, did_you_mean

if TYPE_CHECKING:
    from rlctl.config import RunConfig
    from rlctl.engines.base import ModelSource, TrainEngine

BACKENDS = ("fsdp", "megatron")


def build_engine(
    cfg: RunConfig,
    plan,
    *,
    role: str,
    trainable: bool = True,
    total_steps: int = 0,
    lr: float | None = None,
    source: ModelSource | None = None,
    lora: bool | None = None,
) -> TrainEngine:
    """The engine for ``plan.backend`` ("fsdp" or "megatron"; the plan as a Plan, a dict or plan.json's namespace).

    Args: see :class:`rlctl.engines.fsdp.FSDPEngine` (role "actor" / "ref" / "critic", ``trainable``,
    ``total_steps`` of the lr schedule, peak ``lr``, weight ``source``, ``lora``).
    """
    backend = (plan.get("backend") if isinstance(plan, Mapping) else getattr(plan, "backend", None)) or "fsdp"
    kwargs = {
        "role": role,
        "trainable": trainable,
        "total_steps": total_steps,
        "lr": lr,
        "source": source,
        "lora": lora,
    }
    if backend == "fsdp":
        from rlctl.engines.fsdp import FSDPEngine

        return FSDPEngine(cfg, plan, **kwargs)
    if backend == "megatron":
        from rlctl.engines import megatron

        return megatron.build_engine(cfg, plan, **kwargs)
    raise UserError(
        f"unknown parallel.backend {backend!r}{did_you_mean(str(backend), BACKENDS)}; use {' or '.join(BACKENDS)}"
    )
