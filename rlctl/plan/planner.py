"""Resolve a configuration into a :class:`Plan`: every "auto" choice made, with its reason.

The planner is a pure function of the configuration (model, GPU type and count, nodes, method,
LoRA, overrides) and of a :class:`LocalEnv`. The local machine only matters where docs/presets.md
says so: the device and GPU type when they are not given, the CPU engine (vLLM when installed,
else HF), and warnings about packages missing here. A GPU plan printed on a laptop is the plan the
cluster runs.

The search: for each option in order of preference (the backend tier without offload, FSDP2
without offload for a Megatron-tier model, then Megatron with its optimizer on the CPU, Megatron
offloading its weights during rollout too, FSDP2 offloading every sharded state), each parallel
layout in order of preference, each rollout TP size from the smallest: the first combination whose
estimate fits (GPU memory with the safety margin, the nodes' host memory) and whose KV cache holds
an engine's share of the batch wins; every option before it is reported with its closest attempt.
Checkpointing and the micro batch are then relaxed while the update still fits comfortably.
`--what-to-rent` (rlctl.plan.rent) runs this same planner at each GPU count.

The parts, each importing only those before it: types (the Plan), inputs (resolve the job), search
(the options and the relaxing), reasons (in words), core (one plan, :func:`plan_config`), rent
(each GPU count), fit (what would fit), and this module, which adds "what would fit" to a plan that
does not. apply fills a config from a plan.
"""

from __future__ import annotations

from rlctl.config import RunConfig
from rlctl.plan.apply import apply_plan
from rlctl.plan.core import plan_config, plan_with_search
from rlctl.plan.fit import what_would_fit
from rlctl.plan.local import LocalEnv, detect_local
from rlctl.plan.reasons import describe_layout, why_not
from rlctl.plan.search import good_fit, kv_target
from rlctl.plan.types import Plan, load_plan, save_plan

__all__ = [
    "Plan",
    "apply_plan",
    "describe_layout",
    "good_fit",
    "kv_target",
    "load_plan",
    "plan_config",
    "resolve_plan",
    "save_plan",
    "why_not",
]


def resolve_plan(cfg: RunConfig, *, local: LocalEnv | None = None, host_memory_bytes: int = 0) -> Plan:
    """Choose every "auto" setting of ``cfg`` for its model and hardware, with reasons; a plan that
    does not fit ends with what would.

    ``host_memory_bytes``: the host memory of one node of the cluster (0 = the GPU type's typical
    node, shared by the GPUs used on it).
    """
    local = local if local is not None else detect_local()
    plan, job, result = plan_with_search(cfg, local, host_memory_bytes=host_memory_bytes)
    if not plan.fits:
        plan.reasons.append(what_would_fit(cfg, local, job, result))
    return plan
