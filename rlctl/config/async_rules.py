"""The rules of streaming RL (``rollout.mode = "stream"``, docs/async.md), in one place, torch-free: each a
one-line problem naming the fix, or None. rlctl.checks calls them before launch (with the split's own
rules, rlctl.checks.check_split); the rule table folds them in as they are."""

from __future__ import annotations

from rlctl.config.schema import RunConfig


def stream_problem(cfg: RunConfig) -> str | None:
    """What ``rollout.mode = "stream"`` cannot run with (None: nothing)."""
    r = cfg.rollout
    if r.mode != "stream":
        return None
    if not r.procs:
        return "--rollout-mode stream streams from rollout processes: add --rollout-procs 1"
    if r.procs != 1:
        return f"--rollout-mode stream runs one rollout process (--rollout-procs {r.procs}): use --rollout-procs 1"
    if r.stream_chunk < 1:
        return f"rollout.stream_chunk={r.stream_chunk} must be >= 1 (tokens between weight checks; 32 by default)"
    if cfg.algo.dynamic_sampling:
        return "--rollout-mode stream trains every group that finishes; drop DAPO's dynamic sampling"
    return None
