"""The plan: how a job runs on given hardware (backend, parallel sizes, rollout engine, micro
batch, checkpointing, offload, dtype), each choice a :class:`Decision` with its reason, and its memory
estimate and verdict.

:func:`resolve_plan` is a pure function of the configuration and a :class:`LocalEnv` (what the
machine printing the plan has); :func:`apply_plan` fills a config's open fields (None) from a plan.

The modules, each importing only those before it: types (the Plan and its JSON), rules (thresholds
and legal sizes), inputs (the local machine and the job), search (the options, layouts and rollout
TPs; the margin checks), relax (checkpointing and the micro batch of a plan that fits), decisions (the
choices in words), planner (choose the backend, then search, relax, explain; apply_plan), advice (what
would fit, what to rent); render and compare print them.
"""

import dataclasses

from rlctl.config import RunConfig
from rlctl.plan.advice import RentRow, what_to_rent, what_would_fit
from rlctl.plan.inputs import LocalEnv, detect_local
from rlctl.plan.planner import apply_plan, plan_config, plan_with_search
from rlctl.plan.types import Decision, Plan, Verdict, load_plan, save_plan

__all__ = [
    "Decision",
    "LocalEnv",
    "Plan",
    "RentRow",
    "Verdict",
    "apply_plan",
    "detect_local",
    "load_plan",
    "plan_config",
    "resolve_plan",
    "save_plan",
    "what_to_rent",
]


def resolve_plan(
    cfg: RunConfig, *, local: LocalEnv | None = None, host_memory_bytes: int = 0, labelled_fraction: float | None = None
) -> Plan:
    """Choose every open (None) setting of ``cfg`` for its model and hardware, with reasons; a plan that
    does not fit carries what would (``plan.advice``).

    ``host_memory_bytes``: the host memory of one node of the cluster (0 = the GPU type's typical
    node, shared by the GPUs used on it). ``labelled_fraction``: sft / dpo, the data's labelled share of
    positions where it was measured (:mod:`rlctl.data.labelled`).
    """
    local = local if local is not None else detect_local()
    if labelled_fraction is not None:
        local = dataclasses.replace(local, labelled_fraction=labelled_fraction)
    plan, job, result = plan_with_search(cfg, local, host_memory_bytes=host_memory_bytes)
    if not plan.fits:
        plan.advice = what_would_fit(cfg, local, job, result)
    return plan
