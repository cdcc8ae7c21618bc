"""`rlctl eval --tools`: training's multi-turn agent loop and tools, on the tiny model trained to call ``add``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agents.conftest import TOOLS_FILE, agent_model_dir  # noqa: F401 (the fixture)
from tests.support.cli import rlctl_in_process

REWARD = Path(__file__).resolve().parents[1] / "support" / "agent_rewards.py"


def test_eval_with_tools_runs_the_agent_loop(agent_model_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """The model calls add(3, 4), the tool answers 7, the model says so: the conversation-reading reward
    (1 for the answer in the last assistant turn + 0.1 per tool call) is 1.1 for the right answer, 0.1 for a
    wrong one; the rows count the turns and the call."""
    tools = tmp_path / "tools.py"
    tools.write_text(TOOLS_FILE)
    rows = [{"prompt": "What is 3 + 4?", "answer": "7"}, {"prompt": "What is 3 + 4?", "answer": "8"}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out_file = tmp_path / "rows.jsonl"
    args = ["eval", str(agent_model_dir), "--data", str(data), "--tools", str(tools), "--reward", f"{REWARD}:answered"]
    args += ["--max-prompt-len", "160", "--max-new-tokens", "96", "--set", "agent.max_turns=3", "--json"]
    code, out = rlctl_in_process(monkeypatch, capsys, *args, "-o", str(out_file))
    assert code == 0, out[-3000:]
    (summary,) = [json.loads(line) for line in out.splitlines() if line.startswith('{"model"')]
    got = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["reward"] for r in got] == pytest.approx([1.1, 0.1])
    assert [(r["turns"], r["tool_calls"], r["tool_errors"]) for r in got] == [(2, 1, 0), (2, 1, 0)]
    assert "7" in got[0]["response"] and summary["accuracy"] == 0.5 and summary["pass@1"] == 0.5


def test_chat_prompt_with_tools(agent_model_dir, tmp_path, monkeypatch, capsys):  # noqa: F811
    """chat --tools --prompt: the model calls add(3, 4), the tool's 7 comes back, and the reply on stdout is
    the conversation's last assistant message, the one the model was trained on; the call goes to stderr."""
    import sys

    from rlctl.cli.app import main
    from tests.agents.conftest import trace_messages

    tools = tmp_path / "tools.py"
    tools.write_text(TOOLS_FILE)
    args = ["chat", str(agent_model_dir), "--prompt", "What is 3 + 4?", "--tools", str(tools), "--max-new-tokens", "96"]
    monkeypatch.setattr(sys, "argv", ["rlctl", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code in (0, None)
    out = capsys.readouterr()
    assert out.out == trace_messages()[-1]["content"] + "\n"
    assert "[tool add] 7" in out.err and '"name": "add"' in out.err, out.err
