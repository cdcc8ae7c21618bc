"""Issue 37, item 6: a sync tool call that runs over its timeout keeps nothing running.

Before issue 36's worker processes, each timed-out sync call left its thread running for the rest of the
run (about 14 a step with a hanging tool). Now the call's process is killed at the timeout: the number of
threads and of live worker processes stays bounded however many calls time out."""

from __future__ import annotations

import threading
from pathlib import Path

import psutil

from rlctl.agents.tools import ToolCall, load_agent_spec, run_calls

CALC = str(Path(__file__).resolve().parents[1] / "agents" / "files" / "calc_tools.py")


def _children() -> int:
    return sum(1 for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie")


def test_timed_out_sync_calls_leave_no_thread_and_no_process_behind():
    spec = load_agent_spec(tools=CALC, results="rlctl")
    run_calls([(spec.open({}), ToolCall("add", {"a": 1, "b": 2}))], timeout_s=5, max_chars=100)  # warm up
    threads, children = threading.active_count(), _children()
    for _ in range(4):  # four rounds of three hanging calls each: 12 timeouts
        trajectories = [spec.open({}) for _ in range(3)]
        out = run_calls([(t, ToolCall("sleepy", {"seconds": 30})) for t in trajectories], timeout_s=0.3, max_chars=100)
        assert [o.status for o in out] == ["timeout"] * 3
        for t in trajectories:
            t.close()
    assert threading.active_count() <= threads + 1  # not one per timed-out call (12 on the old code)
    assert _children() <= children + 3  # at most a round's worth of warm workers, none still sleeping
