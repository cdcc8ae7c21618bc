"""The launcher's report: a real torchrun launch whose rank 1 fails shows one line, with the right exit code.

The ranks run ``tests/support/scripts/failing_rank.py`` instead of the recipe (``RLCTL_TEST_RECIPE``), so
the failure is certain and fast; everything else (checks, run directory, torchrun, the report) is real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlctl.launch import read_rank_errors, root_cause
from rlctl.runtime.errors import write_rank_error
from rlctl.runtime.layout import RunPaths
from tests.support.cli import REPO, run_cli
from tests.support.sft import write_jsonl

HOOK = {"RLCTL_TEST_RECIPE": "tests.support.scripts.failing_rank"}
USER_MESSAGE = "data.answer_field 'solution' is missing in row 3; pass --set data.answer_field=FIELD"


def _args(model: Path, data: Path, out: Path) -> list[str]:
    return [
        "grpo",
        "--model",
        str(model),
        "--data",
        str(data),
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--reward",
        "exact",
        "--max-prompt-len",
        "48",
        "--max-response-len",
        "12",
        "--output-dir",
        str(out),
    ]


def _console(r) -> list[str]:
    """What the user sees, less the run-directory line printed before launch."""
    return [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip() and not ln.startswith("run directory:")]


@pytest.fixture
def data(tmp_path) -> Path:
    return write_jsonl(tmp_path / "rl.jsonl", [{"prompt": "1+1=", "answer": "2"}] * 4)


def test_earliest_non_interrupted_error_is_the_root_cause(tmp_path):
    write_rank_error(tmp_path, 3, "interrupted", "KeyboardInterrupt")
    time.sleep(0.01)
    write_rank_error(tmp_path, 2, "user", "the real problem;\n fix it")
    time.sleep(0.01)
    write_rank_error(tmp_path, 0, "internal", "RuntimeError: [gloo] Connection closed by peer")
    errors = read_rank_errors(RunPaths(tmp_path))
    assert [e["rank"] for e in errors] == [3, 2, 0]  # by time, not by rank
    assert root_cause(errors)["rank"] == 2
    assert root_cause(errors)["message"] == "the real problem; fix it"  # one line
    assert root_cause(errors[:1]) is None


@pytest.mark.slow
def test_a_user_error_on_rank_1_is_one_line_exit_2(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    r = run_cli(*_args(tiny_model_dir, data, out), env={**HOOK, "FAIL_MODE": "user"}, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert _console(r) == [f"error: {USER_MESSAGE}"], r.stderr  # torchrun's report never reaches the console
    assert not out.exists()  # a refused job leaves no run directory (issue 37: the one line says it all)


@pytest.mark.slow
def test_an_internal_error_names_the_rank_and_the_log_exit_1(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    r = run_cli(*_args(tiny_model_dir, data, out), env={**HOOK, "FAIL_MODE": "internal"}, cwd=tmp_path)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = _console(r)
    assert len(lines) == 1, lines
    assert "internal error on rank 1: ZeroDivisionError: division by zero" in lines[0]
    assert str(out / "train.log") in lines[0]
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_ctrl_c_during_start_up_exits_130_with_a_summary(tiny_model_dir, data, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, **HOOK, "FAIL_MODE": "hang"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlctl", *_args(tiny_model_dir, data, out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not all((out / f"started_rank_{rank}").is_file() for rank in (0, 1)):  # the ranks are up, before step 1
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (stdout, stderr)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["step"] == 0
    assert "Traceback" not in stderr and "interrupted during start-up" in stderr
