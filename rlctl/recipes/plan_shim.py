"""Temporary: the engines still take a plan object in ``build_engine(cfg, plan, ...)``."""

from __future__ import annotations

import json
from types import SimpleNamespace

from rlctl.runtime.entry import RunContext


def engine_plan(ctx: RunContext) -> SimpleNamespace:
    # lead: replace with EngineSpec.from_config(cfg)
    """plan.json as an object, for ``build_engine`` only (everything else reads the resolved config)."""
    return SimpleNamespace(**json.loads(ctx.paths.plan.read_text()))
