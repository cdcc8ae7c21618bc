"""Fill a configuration's "auto" fields from a plan."""

from __future__ import annotations

import copy

from rlctl.config import RunConfig
from rlctl.plan.types import Plan


def apply_plan(cfg: RunConfig, plan: Plan) -> RunConfig:
    """A copy of ``cfg`` with every "auto", None (or 0) field the plan decides filled in."""
    out = copy.deepcopy(cfg)
    m, hw, par, tr, ro = out.model, out.hardware, out.parallel, out.train, out.rollout
    if m.dtype == "auto":
        m.dtype = plan.dtype
    # model.attn stays "auto": the engine picks flash_attention_2 where flash-attn is installed on
    # the GPU host and sdpa otherwise, at run time (plan.attn says what a GPU cluster will get).
    if hw.device == "auto":
        hw.device = plan.device
    if plan.device == "cuda":
        hw.gpus = hw.gpus or plan.gpus
        hw.gpu = hw.gpu or plan.gpu
    hw.nproc = hw.nproc or plan.nproc_per_node
    if par.backend == "auto":
        par.backend = plan.backend
    par.tp, par.pp, par.ep = par.tp or plan.tp, par.pp or plan.pp, par.ep or plan.ep
    for key, value in (
        ("sequence_parallel", plan.sequence_parallel),
        ("activation_checkpointing", plan.activation_checkpointing),
        ("offload_params", plan.offload_params),
        ("offload_optimizer", plan.offload_optimizer),
        ("selective_checkpointing", plan.selective_checkpointing),
        ("offload_activations", plan.offload_activations),
        ("shard", plan.shard),
    ):
        if getattr(par, key) is None:
            setattr(par, key, bool(value))
    tr.micro_batch_size = tr.micro_batch_size or plan.micro_batch_size
    if plan.rollout is not None:
        if ro.engine == "auto":
            ro.engine = plan.rollout
        ro.tp = ro.tp or plan.rollout_tp
        ro.mem_fraction = ro.mem_fraction or plan.rollout_mem_fraction
    return out
