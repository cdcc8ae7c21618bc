"""Advice: the planner run at other sizes. What to rent: for each catalog GPU type, the fewest GPUs a job
fits on, with its plan; what would fit: the changes that make an unfit job fit (more GPUs, LoRA, a bigger
GPU, more host memory).

Counts tried: 1, 2, 4, ... up to a full node, then whole nodes 2, 3, ..., 8, then 16, 32 and 64
(``rent.max_nodes`` in presets/tiers.yaml). Each GPU type gets two rows: the fewest GPUs that fit
**without** offload, and the fewest when offload is allowed (host memory permitting; that plan
offloads only if it must). The plan of a row is the planner's own for that count (with offload
switched off for the first row), so it is what `rlctl <method> --gpus N --gpu TYPE` would run.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from rlctl.catalog import list_gpus
from rlctl.catalog.spec import GpuSpec
from rlctl.config import RunConfig
from rlctl.errors import UserError
from rlctl.estimate.memory import GIB, HOST_MARGIN_FRACTION
from rlctl.plan.inputs import Job, LocalEnv, detect_local
from rlctl.plan.planner import plan_config
from rlctl.plan.rules import tiers
from rlctl.plan.search import SearchResult, good_fit, gpu_margin_ok, kv_ok
from rlctl.plan.types import Plan


@dataclass
class RentRow:
    gpu: str
    gpus: int  # 0 when nothing up to the node limit fits
    nodes: int
    plan: Plan | None
    offload: bool = True  # False: the fewest GPUs without any offload; True: offload allowed where it must

    def to_dict(self) -> dict:
        out: dict = {
            "gpu": self.gpu,
            "offload": self.offload,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "fits": self.plan is not None,
        }
        if self.plan is not None:
            p, est = self.plan, self.plan.estimate
            out.update(
                peak_bytes=est.peak_bytes,
                gpu_memory_bytes=est.gpu_memory_bytes,
                host_bytes=est.host_bytes,
                host_memory_bytes=est.host_memory_bytes,
            )
            out["plan"] = {
                "backend": p.backend,
                "tp": p.tp,
                "pp": p.pp,
                "dp": p.dp,
                "ep": p.ep,
                "sp": p.sp,
                "rollout": p.rollout,
                "rollout_tp": p.rollout_tp,
                "rollout_mem_fraction": p.rollout_mem_fraction,
                "micro_batch_size": p.micro_batch_size,
                "activation_checkpointing": p.activation_checkpointing,
                "offload_params": p.offload_params,
                "offload_optimizer": p.offload_optimizer,
            }
        return out


def gpu_counts(gpu: GpuSpec) -> list[tuple[int, int]]:
    """(gpus, nodes) pairs to try, smallest first."""
    per_node = gpu.gpus_per_node
    single = [(n, 1) for n in (1, 2, 4, 8, 16) if n < per_node] + [(per_node, 1)]
    max_nodes = tiers()["rent"]["max_nodes"]
    nodes = [*range(2, 9), 16, 32, 64, 128, 256]
    return single + [(per_node * n, n) for n in nodes if n <= max_nodes]


def without_offload(cfg: RunConfig) -> RunConfig:
    """A copy of ``cfg`` that may not offload anything."""
    out = copy.deepcopy(cfg)
    out.parallel.offload_params = out.parallel.offload_optimizer = False
    return out


def plan_at(cfg: RunConfig, gpu: GpuSpec, gpus: int, nodes: int, local: LocalEnv, *, host_memory_bytes: int = 0):
    """The planner's plan for ``gpus`` GPUs of this type on ``nodes`` nodes, or None when the
    configuration cannot run there (e.g. a tp 8 override on 4 GPUs)."""
    trial = copy.deepcopy(cfg)
    hw = trial.hardware
    hw.device, hw.gpu, hw.gpus, hw.nodes, hw.nproc = "cuda", gpu.name, gpus, nodes, 0
    try:
        return plan_config(trial, local, host_memory_bytes=host_memory_bytes)
    except UserError:
        return None


def smallest_fit(
    cfg: RunConfig,
    gpu: GpuSpec,
    local: LocalEnv,
    *,
    min_gpus: int = 1,
    host_memory_bytes: int = 0,
    offload: bool = True,
) -> RentRow | None:
    """The fewest GPUs of this type (at least ``min_gpus``) the job fits on with the safety
    margin and a useful KV cache, or None. ``offload=False`` searches plans without offload."""
    trial = cfg if offload else without_offload(cfg)
    for gpus, nodes in gpu_counts(gpu):
        if gpus < min_gpus:
            continue
        plan = plan_at(trial, gpu, gpus, nodes, local, host_memory_bytes=host_memory_bytes)
        if plan is not None and good_fit(plan):
            return RentRow(gpu.name, gpus, nodes, plan, offload)
    return None


def what_to_rent(cfg: RunConfig, *, local: LocalEnv | None = None, host_memory_bytes: int = 0) -> list[RentRow]:
    """Two rows per catalog GPU type: the fewest GPUs without offload, then with offload allowed."""
    local = local if local is not None else detect_local()
    rows = []
    for gpu in list_gpus():
        allowed = smallest_fit(cfg, gpu, local, host_memory_bytes=host_memory_bytes)
        if allowed is not None and not (allowed.plan.offload_params or allowed.plan.offload_optimizer):
            # the planner prefers no offload: the same plan is the fewest GPUs without offload
            none = RentRow(gpu.name, allowed.gpus, allowed.nodes, allowed.plan, offload=False)
        else:
            start = allowed.gpus if allowed is not None else 1
            none = smallest_fit(cfg, gpu, local, min_gpus=start, host_memory_bytes=host_memory_bytes, offload=False)
        rows.append(none or RentRow(gpu.name, 0, 0, None, offload=False))
        rows.append(allowed or RentRow(gpu.name, 0, 0, None, offload=True))
    return rows


def what_would_fit(cfg: RunConfig, local: LocalEnv, job: Job, result: SearchResult) -> list[str]:
    """The changes that would make the job fit, each one way: more GPUs of this type, LoRA, a bigger GPU,
    more host memory per node (rendered by :func:`rlctl.plan.types.advice_line`)."""
    if job.device == "cpu":
        return ["a GPU (--device cuda --gpus N), LoRA (--lora-rank 32), or shorter sequences"]
    options = []
    more = smallest_fit(cfg, job.gpu, local, min_gpus=job.world + 1, host_memory_bytes=job.host_memory_bytes)
    if more is not None:
        options.append(
            f"{more.gpus} x {job.gpu.name} ({more.nodes} node{'s' if more.nodes > 1 else ''}), the fewest that fit"
        )
    if not cfg.lora.rank:
        rank = tiers()["lora"]["suggest_rank"]
        lora_cfg = copy.deepcopy(cfg)
        lora_cfg.lora.rank = rank
        if lora_cfg.rollout.engine == "sglang":
            lora_cfg.rollout.engine = None  # the plan chooses one that runs LoRA
        try:
            if good_fit(plan_config(lora_cfg, local, host_memory_bytes=job.host_memory_bytes)):
                options.append(f"LoRA on these {job.world} GPUs (--lora-rank {rank})")
        except UserError:
            pass
    for gpu in sorted(list_gpus(), key=lambda g: g.memory_bytes):
        if gpu.memory_bytes <= job.gpu.memory_bytes:
            continue
        bigger = copy.deepcopy(cfg)
        bigger.hardware.gpu, bigger.hardware.gpus, bigger.hardware.device = gpu.name, job.world, "cuda"
        try:
            if good_fit(plan_config(bigger, local, host_memory_bytes=job.host_memory_bytes)):
                options.append(f"{job.world} x {gpu.name}")
                break
        except UserError:
            continue
    host_only = [
        est
        for est in [r.closest for r in result.rejected] + [result.est]
        if not est.host_fits and gpu_margin_ok(est) and kv_ok(est)
    ]
    if host_only:
        need = min(est.host_bytes for est in host_only) / (1 - HOST_MARGIN_FRACTION) / GIB
        options.append(
            f"nodes with {math.ceil(need)} GiB of host memory for these GPUs (--host-memory {math.ceil(need)})"
        )
    if not options:
        limit = tiers()["rent"]["max_nodes"]
        return [f"nothing up to {limit} nodes; shorten the sequences or use LoRA"]
    return options
