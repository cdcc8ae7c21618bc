"""What would fit: the changes that make an unfit job fit (more GPUs, LoRA, a bigger GPU, more host memory)."""

from __future__ import annotations

import copy
import math

from rlctl.catalog import list_gpus
from rlctl.config import RunConfig
from rlctl.errors import UserError
from rlctl.estimate.memory import GIB, HOST_MARGIN_FRACTION
from rlctl.plan import rules
from rlctl.plan.core import plan_config
from rlctl.plan.inputs import Job
from rlctl.plan.local import LocalEnv
from rlctl.plan.rent import smallest_fit
from rlctl.plan.search import SearchResult, good_fit, gpu_margin_ok, kv_ok


def what_would_fit(cfg: RunConfig, local: LocalEnv, job: Job, result: SearchResult) -> str:
    """Name the changes that would make the job fit: more GPUs of this type, LoRA, a bigger GPU,
    more host memory per node."""
    if job.device == "cpu":
        return "what would fit: a GPU (--device cuda --gpus N), LoRA (--lora-rank 32), or shorter sequences"
    options = []
    more = smallest_fit(cfg, job.gpu, local, min_gpus=job.world + 1, host_memory_bytes=job.host_memory_bytes)
    if more is not None:
        options.append(
            f"{more.gpus} x {job.gpu.name} ({more.nodes} node{'s' if more.nodes > 1 else ''}), the fewest that fit"
        )
    if not cfg.lora.rank:
        rank = rules.tiers()["lora"]["suggest_rank"]
        lora_cfg = copy.deepcopy(cfg)
        lora_cfg.lora.rank = rank
        if lora_cfg.rollout.engine == "sglang":
            lora_cfg.rollout.engine = "auto"
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
        limit = rules.tiers()["rent"]["max_nodes"]
        return f"what would fit: nothing up to {limit} nodes; shorten the sequences or use LoRA"
    return "what would fit: " + "; or ".join(options)
