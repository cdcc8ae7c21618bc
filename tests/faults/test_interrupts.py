"""Ctrl-C twice (issue 24): the second one kills the ranks before they could save or write
summary.json; the launcher then names the last checkpoint on disk and its step, never "start-up"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.cli import REPO
from tests.support.sft import chat_rows, write_jsonl

pytestmark = pytest.mark.slow


def test_a_second_ctrl_c_names_the_last_checkpoint(tiny_model_dir, tmp_path):
    data, out = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8)), tmp_path / "run"
    args = ["sft", "--model", str(tiny_model_dir), "--data", str(data), "--device", "cpu", "--nproc", "1"]
    env = {**os.environ, "RLCTL_TEST_RECIPE": "tests.support.scripts.saved_then_stuck", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlctl", *args, "-o", str(out)],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "started").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # the launcher has read step 3 from metrics.jsonl
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    console = stdout + stderr
    assert proc.returncode == 130, console
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 2, summary
    assert summary["checkpoint"].endswith("step_000002"), summary
    assert "start-up" not in console and "step_000002" in console, repr(console)
