"""One owner per run directory (issue 37, item 1): two launches into one directory, at once.

The race is real: two ``python -m rlctl sft`` processes, the real checks, lock, torchrun and report; the
ranks run a stand-in recipe (``tests/support/scripts/logs_steps.py``, ``RLCTL_TEST_RECIPE``) that holds
after step 1 until the test lets it go, so the first run is certainly alive while the second starts. The
lock's rules (a dead owner, a reused pid, another host's heartbeat, the nodes of one job) are checked on
real files in this process.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlctl.errors import UserError
from rlctl.runtime import run_lock
from rlctl.runtime.run_lock import LOCK_NAME, STALE_S, take_run_dir
from tests.support.cli import REPO
from tests.support.sft import chat_rows, write_jsonl


def _start(model: Path, data: Path, out: Path, seed: int, go: Path) -> subprocess.Popen:
    args = ["sft", "--model", str(model), "--data", str(data), "--device", "cpu", "--nproc", "1"]
    args += ["--max-steps", "4", "--seed", str(seed), "-o", str(out)]
    env = {**os.environ, "RLCTL_TEST_RECIPE": "tests.support.scripts.logs_steps", "RLCTL_TEST_GO": str(go)}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen(
        [sys.executable, "-m", "rlctl", *args],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
def test_two_runs_racing_on_one_directory_one_is_refused_naming_the_other(tiny_model_dir, tmp_path):
    data, out, go = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8)), tmp_path / "run", tmp_path / "go"
    procs = {seed: _start(tiny_model_dir, data, out, seed, go) for seed in (1, 2)}
    try:
        deadline = time.monotonic() + 240
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline:  # one is refused, or (no lock) both have logged step 1
            if any(p.poll() is not None for p in procs.values()):
                break
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        go.touch()
        results = {seed: (p.communicate(timeout=240), p.returncode) for seed, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
    codes = sorted(rc for _, rc in results.values())
    assert codes == [0, 2], results
    winner = next(seed for seed, (_, rc) in results.items() if rc == 0)
    (out_text, err_text), _ = results[3 - winner]
    lines = [ln for ln in (out_text + err_text).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "in use by another rlctl run" in lines[0], lines
    named = re.search(r"pid (\d+) on host (\S+), started (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)", lines[0])
    assert named and int(named[1]) == procs[winner].pid and named[2] == socket.gethostname(), lines[0]
    steps = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # one run's records, once
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["seed"] == winner
    assert not (out / LOCK_NAME).exists()  # released when the winner ended


# ---------------------------------------------------------------------------------------------
# The lock's rules, on real files


@pytest.fixture(autouse=True)
def _release():
    yield
    run_lock.release_all()


def _plant(run: Path, **record) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    base = {"pid": 1, "host": socket.gethostname(), "started": "2026-01-01 00:00:00 UTC", "token": "t0", "key": None}
    (run / LOCK_NAME).write_text(json.dumps({**base, **record}))
    return run / LOCK_NAME


def _dead_pid() -> tuple[int, float]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    started = run_lock._proc_start(p.pid)
    p.wait()
    return p.pid, started


def test_a_live_owner_on_this_host_refuses_and_a_dead_one_is_broken(tmp_path):
    run = tmp_path / "run"
    me = os.getppid()  # a live process that is not this one
    _plant(run, pid=me, pids=[[me, run_lock._proc_start(me)]])
    with pytest.raises(UserError, match=f"in use by another rlctl run \\(pid {me} on host"):
        take_run_dir(run)
    pid, started = _dead_pid()
    _plant(run, pid=pid, pids=[[pid, started]])
    notes: list[str] = []
    lock = take_run_dir(run, notes=notes)
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert notes and f"pid {pid}" in notes[0] and "gone" in notes[0]
    lock.release()
    assert not (run / LOCK_NAME).exists() and run.is_dir()  # the directory was there before: it stays


def test_a_reused_pid_is_not_the_owner(tmp_path):
    run = tmp_path / "run"
    me = os.getppid()  # alive, but not when the recorded process started
    _plant(run, pid=me, pids=[[me, run_lock._proc_start(me) - 500.0]])
    take_run_dir(run).release()


def test_another_hosts_lock_holds_while_its_heartbeat_lasts(tmp_path):
    run = tmp_path / "run"
    path = _plant(run, host="gpu-node-that-is-not-here", pid=4242)
    with pytest.raises(UserError, match="pid 4242 on host gpu-node-that-is-not-here"):
        take_run_dir(run)
    old = time.time() - STALE_S - 5
    os.utime(path, (old, old))  # no heartbeat for longer than STALE_S: that launcher is gone
    take_run_dir(run).release()


def test_the_nodes_of_one_job_share_the_lock_and_other_jobs_do_not(tmp_path):
    run = tmp_path / "run"
    first = take_run_dir(run, "slurm=7 rendezvous=node0:29500")
    run_lock._HELD.clear()  # as if another node's launcher
    joined = take_run_dir(run, "slurm=7 rendezvous=node0:29500")
    assert not joined.owner
    run_lock._HELD.clear()
    with pytest.raises(UserError, match="in use by another rlctl run"):
        take_run_dir(run, "slurm=8 rendezvous=node3:29500")
    first.release()
    assert not run.exists()  # it made the directory and nothing was written: none is left


def test_a_refused_launch_removes_the_directories_it_made(tmp_path):
    run = tmp_path / "runs" / "a" / "run"
    lock = take_run_dir(run)
    (run / "config.yaml").write_text("x")
    lock.release(remove_dir=True)
    assert not (tmp_path / "runs").exists()


def test_the_owner_keeps_its_lock_fresh_while_it_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.05)
    lock = take_run_dir(tmp_path / "run")
    old = time.time() - STALE_S - 5
    os.utime(lock.path, (old, old))
    time.sleep(0.5)
    assert time.time() - lock.path.stat().st_mtime < 5  # another host would not break it
    lock.release()
