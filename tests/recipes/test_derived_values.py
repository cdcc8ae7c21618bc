"""Values derived from other settings are written once into the resolved config (rlctl.plan.apply_plan),
so the run's config.yaml says what ran: ``agent.max_turns`` of an agent run, an RL run's
``algo.mini_batch_size``. Read here from ``--dry-run --json``, the resolved config the launcher saves."""

from __future__ import annotations

import json

import pytest

from tests.agents.conftest import TOOLS_FILE
from tests.support.cli import rlctl_in_process
from tests.support.rl import arith_rows
from tests.support.sft import chat_rows, write_jsonl

# ChatML with Hermes-style tool calls, as Qwen2.5's template writes them
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>\n{{ tc.function | tojson }}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _resolved(monkeypatch, capsys, method: str, *args: str) -> dict:
    # the tiny model's context is 512 tokens: --dry-run refuses what the launch refuses (issue 37)
    lengths = ("--max-len", "256") if method == "sft" else ("--max-prompt-len", "128", "--max-response-len", "128")
    code, out = rlctl_in_process(monkeypatch, capsys, method, *args, *lengths, "--device", "cpu", "--dry-run", "--json")
    assert code == 0, out
    return json.loads(out)["config"]


@pytest.mark.parametrize(
    ("extra", "turns", "mini"),
    [((), 8, 4), (("--max-turns", "3", "--mini-batch-size", "2"), 3, 2), (("--mini-batch-size", "16"), 8, 4)],
)
def test_agent_run_records_its_max_turns_and_mini_batch(
    monkeypatch, capsys, tiny_model_dir, tmp_path, extra, turns, mini
):
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(8))
    tools = tmp_path / "tools.py"
    tools.write_text(TOOLS_FILE)
    template = tmp_path / "tools.jinja"  # the tiny model's own template has no tool-call format
    template.write_text(TOOL_TEMPLATE)
    args = ("--model", str(tiny_model_dir), "--data", str(data), "--tools", str(tools), "--batch-size", "4")
    args += ("--chat-template", str(template))
    cfg = _resolved(monkeypatch, capsys, "grpo", *args, *extra)
    assert (cfg["agent"]["max_turns"], cfg["algo"]["mini_batch_size"]) == (turns, mini)


def test_single_turn_and_sft_runs_leave_max_turns_unset(monkeypatch, capsys, tiny_model_dir, tmp_path):
    rl = write_jsonl(tmp_path / "rl.jsonl", arith_rows(8))
    cfg = _resolved(monkeypatch, capsys, "ppo", "--model", str(tiny_model_dir), "--data", str(rl), "--batch-size", "6")
    assert cfg["agent"]["max_turns"] is None and cfg["algo"]["mini_batch_size"] == 6
    chats = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    cfg = _resolved(monkeypatch, capsys, "sft", "--model", str(tiny_model_dir), "--data", str(chats))
    assert cfg["agent"]["max_turns"] is None and cfg["algo"]["mini_batch_size"] == 0  # no RL: untouched
