"""One rule for a flag that would have no effect, and --dry-run refuses what the launch refuses (issue 37,
item 5). The CLI runs in this process (the real parsing, job resolution and checks); nothing launches."""

from __future__ import annotations

import pytest

from tests.support.cli import one_line_error, rlctl_in_process
from tests.support.rl import arith_rows
from tests.support.sft import write_jsonl

RL = ("--reward", "exact", "--max-prompt-len", "48", "--max-response-len", "12", "--device", "cpu")
TOOLS = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b
'''


@pytest.fixture
def grpo(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "rl.jsonl", arith_rows(8))
    return ["grpo", "--model", str(tiny_model_dir), "--data", str(data), *RL, "-o", str(tmp_path / "run")]


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize(
    ("flag", "needs"), [(("--max-staleness", "2"), "--rollout-procs"), (("--max-turns", "3"), "--tools")]
)
def test_a_flag_without_what_it_needs_is_refused(monkeypatch, capsys, grpo, tmp_path, flag, needs, dry_run):
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *grpo, *flag, *(["--dry-run"] if dry_run else [])))
    assert line.startswith(f"error: {flag[0]} ") and needs in line, line
    assert not (tmp_path / "run").exists()


def test_set_names_it_too_and_a_saved_config_holding_the_default_is_not_refused(monkeypatch, capsys, grpo, tmp_path):
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *grpo, "--set", "rollout.max_staleness=1"))
    assert "--max-staleness" in line and "--rollout-procs" in line, line
    code, text = rlctl_in_process(monkeypatch, capsys, *grpo, "--dry-run", "--json")
    assert code == 0, text
    import json

    import yaml

    saved = tmp_path / "saved.yaml"  # a resolved config as a run directory keeps it: every default written
    saved.write_text(yaml.safe_dump(json.loads(text)["config"]))
    assert json.loads(text)["config"]["rollout"]["max_staleness"] == 1
    code, text = rlctl_in_process(monkeypatch, capsys, "grpo", "--config", str(saved), "--dry-run", "--json")
    assert code == 0, text


def test_dry_run_refuses_a_tools_run_whose_template_has_no_tool_calls(monkeypatch, capsys, grpo, tmp_path):
    """The tiny model's template renders no tool calls: the launch refused it, the dry run approved it."""
    (tmp_path / "tools.py").write_text(TOOLS)
    args = [*grpo, "--tools", str(tmp_path / "tools.py")]
    launch = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args))
    dry = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args, "--dry-run"))
    assert "no tool-call format" in dry and dry == launch, (dry, launch)
