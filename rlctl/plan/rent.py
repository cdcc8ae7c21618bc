"""What to rent: for each catalog GPU type, the fewest GPUs a job fits on, with its plan.

Counts tried: 1, 2, 4, ... up to a full node, then whole nodes 2, 3, ..., 8, then 16, 32 and 64
(``rent.max_nodes`` in presets/tiers.yaml). The plan for each count is the planner's own, so the
row is what `rlctl <method> --gpus N --gpu TYPE` would run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from rlctl.catalog import list_gpus
from rlctl.catalog.spec import GpuSpec
from rlctl.config import RunConfig
from rlctl.errors import UserError
from rlctl.plan.local import LocalEnv, detect_local
from rlctl.plan.rules import tiers


@dataclass
class RentRow:
    gpu: str
    gpus: int  # 0 when nothing up to the node limit fits
    nodes: int
    plan: object | None  # rlctl.plan.Plan

    def to_dict(self) -> dict:
        out = {"gpu": self.gpu, "gpus": self.gpus, "nodes": self.nodes, "fits": self.plan is not None}
        if self.plan is not None:
            p = self.plan
            out["plan"] = {
                "backend": p.backend, "tp": p.tp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "rollout": p.rollout,
                "rollout_tp": p.rollout_tp, "rollout_mem_fraction": p.rollout_mem_fraction,
                "micro_batch_size": p.micro_batch_size, "activation_checkpointing": p.activation_checkpointing,
                "offload_params": p.offload_params, "offload_optimizer": p.offload_optimizer,
                "peak_bytes": p.estimate.peak_bytes, "gpu_memory_bytes": p.estimate.gpu_memory_bytes,
            }  # fmt: skip
        return out


def gpu_counts(gpu: GpuSpec) -> list[tuple[int, int]]:
    """(gpus, nodes) pairs to try, smallest first."""
    per_node = gpu.gpus_per_node
    single = [(n, 1) for n in (1, 2, 4, 8, 16) if n < per_node] + [(per_node, 1)]
    max_nodes = tiers()["rent"]["max_nodes"]
    nodes = [*range(2, 9), 16, 32, 64, 128, 256]
    return single + [(per_node * n, n) for n in nodes if n <= max_nodes]


def _try(cfg: RunConfig, gpu: GpuSpec, gpus: int, nodes: int, local: LocalEnv):

    trial = copy.deepcopy(cfg)
    hw = trial.hardware
    hw.device, hw.gpu, hw.gpus, hw.nodes, hw.nproc = "cuda", gpu.name, gpus, nodes, 0
    from rlctl.plan.planner import _plan

    try:
        return _plan(trial, local, explain=False)
    except UserError:  # an override that this count cannot honour (e.g. tp 8 on 4 GPUs)
        return None


def smallest_fit(cfg: RunConfig, gpu: GpuSpec, local: LocalEnv, *, min_gpus: int = 1) -> RentRow | None:
    """The fewest GPUs of this type (at least ``min_gpus``) the job fits on with the safety
    margin, or None."""
    from rlctl.plan.planner import good_fit

    for gpus, nodes in gpu_counts(gpu):
        if gpus < min_gpus:
            continue
        plan = _try(cfg, gpu, gpus, nodes, local)
        if plan is not None and good_fit(plan):
            return RentRow(gpu.name, gpus, nodes, plan)
    return None


def what_to_rent(cfg: RunConfig, *, local: LocalEnv | None = None) -> list[RentRow]:
    """One row per catalog GPU type: the smallest count that fits and its plan."""
    local = local if local is not None else detect_local()
    rows = []
    for gpu in list_gpus():
        rows.append(smallest_fit(cfg, gpu, local) or RentRow(gpu.name, 0, 0, None))
    return rows
