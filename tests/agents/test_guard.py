"""A guarded call's typed outcome: ok with its value, raised (type, one-line text), timed out, or busy;
each failure rendered to text in one place (``Result.why``), and a tool's error text from it."""

from __future__ import annotations

import threading
import time

from rlctl.agents.calls import Tool, ToolCall
from rlctl.agents.episode import Episode
from rlctl.agents.guard import Result, guarded


def boom():
    raise ValueError("bad\n  input")


def test_each_outcome_is_typed_and_says_why_once():
    ok = guarded(lambda: 41 + 1, 5)
    assert ok.ok and ok.value == 42
    raised = guarded(boom, 5)
    assert (raised.status, raised.error_type, raised.error) == ("error", "ValueError", "ValueError: bad input")
    assert raised.message == "bad input" and raised.why(5) == "ValueError: bad input"
    bare = guarded(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), 5)
    assert (bare.error, bare.message) == ("KeyboardInterrupt", "")
    slow = guarded(lambda: time.sleep(2), 0.2)
    assert slow.status == "timeout" and slow.why(0.2) == "took longer than 0.2 s"
    lock = threading.Lock()
    lock.acquire()  # an earlier call that ran over still holds the trajectory's lock
    busy = guarded(lambda: 1, 5, lock)
    assert busy == Result("busy") and busy.why(5) == "was not run: an earlier call is still running"


def test_a_tools_failure_reads_as_its_style_says():
    episode = Episode([], timeout_s=5)
    episode.add_tool("f", Tool(lambda args: boom(), None, style="rlctl"))
    episode.add_tool("g", Tool(lambda args: boom(), None, style="verl"))
    episode.add_tool("h", Tool(lambda args: boom(), None, style="trl"))
    texts = [episode.call(ToolCall(n, {})).content for n in "fgh"]
    assert texts == ["Error: ValueError: bad input", "Error executing tool 'g': bad input", "{'error': 'bad input'}"]
    episode.add_tool("s", Tool(lambda args: time.sleep(2), None))
    out = episode.call(ToolCall("s", {}), timeout_s=0.2)
    assert (out.status, out.content) == ("timeout", "Error: s took longer than 0.2 s and was stopped")
