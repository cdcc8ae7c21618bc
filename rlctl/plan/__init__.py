"""The plan: how a job runs on given hardware (backend, parallel sizes, rollout engine, micro
batch, checkpointing, offload, dtype), each choice with its reason, and its memory estimate.

:func:`resolve_plan` is a pure function of the configuration and a :class:`LocalEnv` (what the
machine printing the plan has); :func:`apply_plan` fills a config's "auto" fields from a plan.
"""

from rlctl.plan.local import LocalEnv, detect_local
from rlctl.plan.planner import apply_plan, resolve_plan
from rlctl.plan.rent import RentRow, what_to_rent
from rlctl.plan.types import Plan, load_plan, save_plan

__all__ = [
    "LocalEnv",
    "Plan",
    "RentRow",
    "apply_plan",
    "detect_local",
    "load_plan",
    "resolve_plan",
    "save_plan",
    "what_to_rent",
]
