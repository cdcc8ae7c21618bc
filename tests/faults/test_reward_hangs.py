"""Reward functions that hang or fail (issue 24): the calls of one step that hang time out together
(the step ends after about one ``reward.timeout``, not one per sample), a stop request ends them, and
a reward's error names the file and line that raised it and reaches the console."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rlctl.rewards.pool import RewardPool
from tests.support.cli import REPO, run_cli
from tests.support.rl import REWARDS, arith_rows, failure
from tests.support.sft import write_jsonl

HANG = (f"{REWARDS}:hangs", "sample", ("ds", "text", "1", None))
TIMEOUT = 3.0


@pytest.mark.parametrize("workers", [0, 1])
def test_the_hanging_calls_of_one_step_time_out_together(workers):
    """8 calls that never return, 1 worker (or none): about one timeout, not 8."""
    pool = RewardPool(workers, TIMEOUT)
    try:
        began = time.monotonic()
        out = pool.map([HANG] * 8)
        took = time.monotonic() - began
    finally:
        pool.close()
    assert all(not ok and "reward.timeout=3" in text for ok, text in out), out
    assert took < 2.5 * TIMEOUT, f"{took:.1f} s for 8 hanging calls of {TIMEOUT:g} s each"


def test_a_stop_request_ends_hanging_reward_calls():
    from rlctl.runtime import signals

    pool = RewardPool(1, 60.0)
    timer = threading.Timer(0.5, signals.note_stop)
    try:
        began = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            pool.map([HANG] * 4)
        assert time.monotonic() - began < 0.5 + 2.0 + 3.0  # STOP_GRACE, and the kill
    finally:
        timer.cancel()
        signals._early["requested"] = False
        pool.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_reward_error_names_the_file_and_line_that_raised_it(workers):
    from types import SimpleNamespace

    from rlctl.rewards import RewardManager
    from rlctl.rewards.manager import RewardBatch

    line = next(i for i, t in enumerate(REWARDS.read_text().splitlines(), 1) if "cannot grade this one" in t)
    cfg = SimpleNamespace(fn=f"{REWARDS}:flaky", fns=[], workers=workers, timeout=10.0, model="")
    manager = RewardManager(cfg)
    try:
        batch = RewardBatch(["p"] * 2, ["a", "a"], [[1]] * 2, [[1]] * 2, ["ds"] * 2, ["a", "raise"], [None] * 2)
        result = manager.score(batch)
    finally:
        manager.close()
    assert f"{REWARDS}:{line})" in result.errors["flaky"], result.errors


# ---------------------------------------------------------------------------------------------
# Through the CLI: real GRPO runs (torchrun, 1 CPU process, the tiny model)


def _grpo(model: Path, data: Path, out: Path, reward: str, *extra: str) -> list[str]:
    args = ["grpo", "--model", str(model), "--data", str(data), "-o", str(out), "--device", "cpu", "--nproc", "1"]
    args += ["--batch-size", "4", "--n", "4", "--max-prompt-len", "48", "--max-response-len", "8"]
    return [*args, "--reward", f"{REWARDS}:{reward}", "--set", "reward.workers=1", *extra]


@pytest.mark.slow
def test_reward_failures_reach_the_console_with_their_line(tiny_model_dir, tmp_path):
    rows = [dict(r, answer="boom") if i % 2 else r for i, r in enumerate(arith_rows(16))]
    data, out = write_jsonl(tmp_path / "rl.jsonl", rows), tmp_path / "run"
    r = run_cli(*_grpo(tiny_model_dir, data, out, "digits", "--max-steps", "2"), cwd=tmp_path)
    assert r.returncode == 0, failure(r, out)
    console = r.stdout + r.stderr
    assert "the reward function failed on" in console and "ValueError: boom" in console, console
    assert "rl_rewards.py:" in console, console


@pytest.mark.slow
def test_sigterm_stops_a_step_whose_rewards_hang(tiny_model_dir, tmp_path):
    data, out, mark = write_jsonl(tmp_path / "rl.jsonl", arith_rows(8)), tmp_path / "run", tmp_path / "calling"
    args = _grpo(tiny_model_dir, data, out, "hangs", "--max-steps", "2", "--set", "reward.timeout=120")
    env = {**os.environ, "RLCTL_TEST_MARK": str(mark), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlctl", *args],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 240
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mark.exists(), "the reward function was never called"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, (stdout, stderr)
    assert time.monotonic() - sent < 30
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"
