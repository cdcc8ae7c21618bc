"""Untrusted text on the operator's terminal is inert (issue 37, item 7).

End to end: a real GRPO run whose tool (``--tools``) returns ANSI and OSC sequences, BEL and NUL, as a web
page a search tool returns might; the tiny model is trained to call it (tests/agents/conftest.py), so the
tool really runs and its result is a sampled conversation's ``tool:`` turn printed by the launcher. The
console's captured BYTES hold none of the control characters, and show them as visible escapes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlctl.terminal import inert
from tests.agents.conftest import agent_model_dir  # noqa: F401  (the tool-calling tiny model)
from tests.support.cli import REPO
from tests.support.sft import write_jsonl

HOSTILE = "\x1b]0;pwned\x07\x1b[31mRED\x1b[0m\x00\x9b2J\u202eevil"
TOOLS = f'''
def add(a: int, b: int) -> int:  # (a str in fact: the annotation the model was trained with)
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b) + {HOSTILE!r}
'''
CONTROL = [bytes([c]) for c in (*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F)] + ["\x9b".encode(), "\u202e".encode()]


def test_inert_escapes_what_a_terminal_obeys_and_keeps_the_rest():
    assert inert(HOSTILE) == "\\x1b]0;pwned\\x07\\x1b[31mRED\\x1b[0m\\x00\\x9b2J\\u202eevil"
    assert inert("tab\tnew\nline é 日本") == "tab\tnew\nline é 日本"
    assert inert("a\nb", keep_newlines=False) == "a\\x0ab"


@pytest.mark.slow
def test_a_tool_returning_escape_sequences_reaches_the_console_inert(agent_model_dir, tmp_path):  # noqa: F811
    (tmp_path / "tools.py").write_text(TOOLS)
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ((3, 4), (3, 4))]
    data, run = write_jsonl(tmp_path / "data.jsonl", rows), tmp_path / "run"
    args = ["grpo", "--model", str(agent_model_dir), "--data", str(data), "-o", str(run), "--device", "cpu"]
    args += ["--nproc", "1", "--batch-size", "2", "--n", "2", "--max-prompt-len", "160", "--max-response-len", "96"]
    args += ["--reward", "exact", "--tools", str(tmp_path / "tools.py"), "--max-turns", "2", "--max-steps", "1"]
    args += ["--samples-every", "1", "--rollout", "hf", "--set", "checkpoint.export_hf=false"]
    res = subprocess.run([sys.executable, "-m", "rlctl", *args], cwd=REPO, capture_output=True, timeout=600)
    console = res.stdout + res.stderr  # bytes, as the terminal would receive them
    assert res.returncode == 0, console.decode(errors="replace")[-3000:]
    assert b"tool:" in console, console.decode(errors="replace")  # the tool ran and its turn was printed
    assert b"7\\x1b]0;pwned\\x07\\x1b[31mRED" in console  # shown, as visible escapes
    found = [c for c in CONTROL if c in console.replace(b"\n", b"").replace(b"\t", b"")]
    assert not found, (found, console.decode(errors="replace")[-2000:])


def test_the_report_summary_shows_names_from_the_run_inert():
    """`rlctl report`'s table: a run directory's name and an eval key (a reward's own key) are the run's text."""
    import io

    from rich.console import Console

    from rlctl.run_report import render_summary

    out = io.StringIO()
    summary = {
        "run": "run\x1b]0;pwned\x07", "method": "grpo", "status": "completed", "steps": 2, "total_steps": 2,
        "time_s": 1.0, "tokens_per_s": 10.0, "metric": "reward", "first": 0.0, "last": 1.0, "best": 1.0,
        "best_step": 2, "nonfinite_steps": [], "evals": [{"step": 2, "val/\x1b[31m[bold]x": 0.5}],
        "checkpoints": [], "hf": None,
    }  # fmt: skip
    render_summary(Console(file=out, width=200, color_system=None), summary)
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text, repr(text)
    assert "run\\x1b]0;pwned\\x07" in text and "val/\\x1b[31m[bold]x 0.5" in text, text
