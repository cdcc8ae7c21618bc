"""The :class:`Plan` type and its JSON form (plan.json in a run directory: the record of how the job was planned).

No torch import and nothing of the planner: a rank or a tool reads a plan without planning.
``Plan.from_dict(plan.to_dict()) == plan``, through JSON too; a dict with an unknown or a missing
key is a one-line :class:`~rlctl.errors.UserError`.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path

from rlctl.errors import UserError
from rlctl.estimate.result import MemoryEstimate
from rlctl.estimate.settings import check_keys


@dataclass
class Plan:
    method: str
    model: str  # catalog name or path
    params: int
    device: str  # cuda | cpu
    gpu: str  # catalog GPU type, or "cpu"
    gpus: int  # devices the job uses (0 on CPU)
    nodes: int
    nproc_per_node: int
    backend: str  # fsdp | megatron
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    sequence_parallel: bool
    rollout: str | None  # hf | vllm | sglang; None for sft
    rollout_tp: int
    rollout_mem_fraction: float
    micro_batch_size: int
    activation_checkpointing: bool
    selective_checkpointing: bool  # MLPs recomputed, attention kept (FSDP)
    offload_activations: bool  # saved activations in pinned host memory (FSDP)
    shard: bool  # FSDP2 sharding; False: the plain module on one device
    offload_params: bool
    offload_optimizer: bool
    dtype: str
    attn: str
    lora_rank: int
    reasons: list[str]
    warnings: list[str]
    estimate: MemoryEstimate
    fits: bool

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "estimate"}
        out["reasons"], out["warnings"] = list(self.reasons), list(self.warnings)
        out["estimate"] = self.estimate.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        """The inverse of :meth:`to_dict`; an unknown or missing key is a UserError."""
        check_keys("plan", d, [f.name for f in fields(cls)])
        kw = {**d, "reasons": list(d["reasons"]), "warnings": list(d["warnings"])}
        kw["estimate"] = MemoryEstimate.from_dict(d["estimate"])
        return cls(**kw)


def save_plan(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` as JSON to ``path`` atomically (a reader sees the old file or the new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(plan.to_dict(), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_plan(path: str | Path) -> Plan:
    """The plan saved at ``path``; a missing or unreadable file is a one-line UserError."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no plan at {path}: run the job (or its --dry-run) to plan it again") from None
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the plan {path}: {e}; delete it and plan again") from None
    try:
        return Plan.from_dict(data)
    except UserError as e:
        raise UserError(f"{path}: {e}") from None
