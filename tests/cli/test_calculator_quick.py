"""`examples/calculator/run.py --quick` exercises the multi-turn loop (issue 37, item 13): its GRPO steps make
tool calls that run, and trajectories take a second turn after the tool's message; the held-out evaluation
calls the tool too. Before, the quick SFT (6 steps) left a model that never produced a well-formed call."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.support.cli import REPO

pytestmark = pytest.mark.slow


def test_quick_mode_calls_tools(tmp_path):
    out = tmp_path / "calc"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    script = REPO / "examples" / "calculator" / "run.py"
    res = subprocess.run(
        [sys.executable, str(script), "--quick", "--nproc", "1", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "tool_grpo" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "step" in r and r.get("kind") != "eval"]
    assert steps and all(r["tool/calls"] > 0 and r["turns/mean"] > 1 for r in steps), steps
    row = re.search(r"calculator tool\s*│[^\n]*│\s*(\d+)\s*│", res.stdout)  # the results table's row
    assert row and int(row[1]) > 0, res.stdout[-2000:]  # calls on the held-out set
