"""A tool result with no room left under --max-response-len is not appended; the logs say so (issue 37,
item 2). A real GRPO run (CLI, hf rollout) of the tiny model trained to call ``add``: its call fits in 30
tokens, the tool turn does not, so the policy never reads the result. samples.jsonl and the console must show
the conversation the policy saw, and the tool turn marked dropped, never as a turn it read."""

from __future__ import annotations

import json

import pytest

from tests.agents.conftest import TOOLS_FILE, agent_model_dir  # noqa: F401  (the tool-calling tiny model)
from tests.support.cli import run_cli
from tests.support.rl import failure
from tests.support.sft import write_jsonl

pytestmark = pytest.mark.slow


def test_a_tool_turn_without_room_is_logged_as_dropped(agent_model_dir, tmp_path):  # noqa: F811
    (tmp_path / "tools.py").write_text(TOOLS_FILE)
    data, run = (
        write_jsonl(tmp_path / "data.jsonl", [{"prompt": "What is 3 + 4?", "answer": "7"}] * 2),
        tmp_path / "run",
    )
    args = ["grpo", "--model", str(agent_model_dir), "--data", str(data), "-o", str(run), "--device", "cpu"]
    args += ["--nproc", "1", "--batch-size", "2", "--n", "2", "--max-prompt-len", "160", "--max-response-len", "30"]
    args += ["--reward", "exact", "--tools", str(tmp_path / "tools.py"), "--max-turns", "3", "--max-steps", "1"]
    args += ["--samples-every", "1", "--rollout", "hf", "--set", "checkpoint.export_hf=false"]
    res = run_cli(*args)
    assert res.returncode == 0, failure(res, run)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    called = [s for s in samples if any(m.get("tool_calls") for m in s["messages"])]
    assert called, samples  # the model called its tool (the test exercises the dropped path)
    for s in called:
        assert s["finish_reason"] == "length" and s["truncated"], s
        tools = [m for m in s["messages"] if m["role"] == "tool"]
        assert tools and all(m.get("dropped") is True for m in tools), s["messages"]
        assert s["messages"][-1]["role"] == "tool"  # after what the policy read, marked
    console = res.stdout + res.stderr
    assert "tool (dropped): 7" in console, console
    assert "tool:      7" not in console
