"""Streaming RL against synchronous and one-step-off through the real ``rlctl grpo`` CLI, on a tool workload.

    python benchmarks/async_vs_sync_cli.py [--rounds 2] [--steps 6] [--tool-s 0.5] [--out FILE.json]

The sibling of ``benchmarks/async_vs_sync.py`` (a harness of rlctl's parts with a plain trainer): here every
column is a whole ``rlctl grpo`` run (torchrun, FSDP2 trainer, hf rollout engine, the agent loop, rewards,
checkpoints), 2 processes on this CPU:

* ``sync2``: ``--nproc 2``, colocated: each process generates its half of the batch (turns in lockstep: a
  turn waits for every tool call of the process's trajectories), then both update;
* ``fixed``: ``--nproc 2 --rollout-procs 1`` (one-step-off: batch t from the weights after update t - 1);
* ``stream``: ``--nproc 2 --rollout-procs 1 --rollout-mode stream --max-staleness S``.

The workload: the tiny Qwen2 of the agent tests (rlctl.testing, tools=True), trained for a few seconds to
call ``add`` and then answer (a random model never emits a tool call); ``add`` sleeps an exponential time
(mean ``--tool-s``: latency that costs no CPU) in its worker process. BATCH prompts x N trajectories per
update. Unlike the harness, turn lengths and the number of calls are the model's own (one call, short
turns), not geometric: the long tail here is the tool's.

Seconds per update: the median gap between consecutive metrics records after WARMUP updates (the records'
wall-clock stamps: start-up is not counted), then the median over rounds; throughput = BATCH x N / that.
Columns interleave (every column once per round, the order rotating), round r runs seed r in every column
(paired), and the load average is recorded around each run. Reward per sample: each run's mean
``reward/mean`` over its updates, paired by seed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BATCH, N, WARMUP = 4, 4, 2
TOOLS = '''
import random
import time

_rng = random.Random()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    time.sleep(_rng.expovariate(1 / {mean}))
    return a + b
'''


def model(tmp: Path) -> Path:
    from rlctl.testing import build_tiny_model
    from tests.agents.conftest import _memorize  # the agent tests' model: it calls add, then answers

    out = build_tiny_model(tmp / "model", seed=0, tools=True)
    _memorize(out)
    return out


def args_for(mode: str, model_dir: Path, tmp: Path, run: Path, seed: int, a: argparse.Namespace) -> list[str]:
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ((3, 4), (1, 6), (2, 5), (0, 7))]
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 8))
    reward = ROOT / "tests" / "support" / "agent_rewards.py"
    common = [
        "--model", str(model_dir), "--data", str(data), "--output-dir", str(run), "--device", "cpu",
        "--nproc", "2", "--batch-size", str(BATCH), "--n", str(N), "--max-prompt-len", "160",
        "--max-response-len", "96", "--lr", str(a.lr), "--reward", f"{reward}:answered", "--tools",
        str(tmp / "tools.py"), "--max-turns", "3", "--rollout", "hf", "--max-steps", str(a.steps),
        "--seed", str(seed), "--set", "checkpoint.export_hf=false", "--set", f"rollout.temperature={a.temperature}",
    ]  # fmt: skip
    extra = {
        "sync2": [],
        "fixed": ["--rollout-procs", "1"],
        "stream": ["--rollout-procs", "1", "--rollout-mode", "stream", "--max-staleness", str(a.staleness)],
    }[mode]
    return common + extra


def one_run(mode: str, model_dir: Path, tmp: Path, seed: int, a: argparse.Namespace) -> dict:
    run = tmp / f"{mode}-{seed}-{time.time_ns()}"
    load = os.getloadavg()[0]
    began = time.perf_counter()
    cmd = [sys.executable, "-m", "rlctl", "grpo", *args_for(mode, model_dir, tmp, run, seed, a)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if res.returncode:
        raise SystemExit(f"{mode} seed {seed} failed:\n{res.stderr[-3000:]}")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("kind", "train") == "train" and "reward/mean" in r]
    gaps = [b["time"] - a["time"] for a, b in zip(recs[WARMUP - 1 :], recs[WARMUP:])]
    out = {
        "mode": mode, "seed": seed, "s_per_update": statistics.median(gaps), "gaps": gaps,
        "reward_mean": statistics.mean(r["reward/mean"] for r in recs), "wall_s": time.perf_counter() - began,
        "load_before": load, "load_after": os.getloadavg()[0],
        "tool_calls": [r.get("tool/calls", 0) for r in recs],
        "turns": [round(r.get("turns/mean", 0), 2) for r in recs],
        "time_rollout": statistics.median(r.get("time/rollout", 0.0) for r in recs[WARMUP:]),
        "time_update": statistics.median(r.get("time/update", r.get("time/actor", 0.0)) for r in recs[WARMUP:]),
        "idle_trainer": statistics.median(r.get("time/rollout_wait", 0.0) for r in recs[WARMUP:]),
        "staleness_max": max(r.get("async/staleness_max", r.get("offpolicy/staleness", 0.0)) for r in recs),
    }  # fmt: skip
    print(json.dumps({k: v for k, v in out.items() if k != "gaps"}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--tool-s", type=float, default=0.5)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--temperature", type=float, default=0.3)  # the model keeps calling its tool
    ap.add_argument("--modes", default="sync2,fixed,stream")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    modes = a.modes.split(",")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "tools.py").write_text(TOOLS.format(mean=a.tool_s))
        model_dir = model(tmp)
        runs = []
        for r in range(a.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            runs += [one_run(m, model_dir, tmp, r, a) for m in order]
    med = {m: statistics.median(x["s_per_update"] for x in runs if x["mode"] == m) for m in modes}
    summary = {"s_per_update": med, "throughput": {m: BATCH * N / v for m, v in med.items()}}
    if {"sync2", "fixed", "stream"} <= set(modes):
        summary["stream_vs_sync2"] = med["sync2"] / med["stream"]
        summary["stream_vs_fixed"] = med["fixed"] / med["stream"]
        summary["fixed_vs_sync2"] = med["sync2"] / med["fixed"]
    summary["reward_by_seed"] = {
        m: {x["seed"]: round(x["reward_mean"], 4) for x in runs if x["mode"] == m} for m in modes
    }
    settings = {"batch": BATCH, "n": N, "steps": a.steps, "warmup": WARMUP, "tool_s": a.tool_s}
    settings |= {"S": a.staleness, "lr": a.lr, "temperature": a.temperature}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps({"settings": settings, "summary": summary, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
