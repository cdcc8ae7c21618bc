"""Soak: the same 2-process GRPO run (tiny model, HF rollout, CPU) N times; does any run crash?

    python benchmarks/soak.py [--runs 5] [--steps 300] [--save-every 25] [--out runs/soak]

A glibc "double free" was once seen in about 1 of 10 40-step CPU runs and never reproduced; this
repeats a long run with periodic checkpoints (each save is a DCP write, a rename and a prune) under
glibc's heap checking (``MALLOC_CHECK_=3``: a heap corruption aborts at once, at the faulty call,
instead of later) and Python's faulthandler (``PYTHONFAULTHANDLER=1``: the Python stack of every
thread on SIGSEGV/SIGABRT goes to train.log). Core dumps are allowed (``ulimit -c unlimited``) when
the system lets them be written.

Each run is classed ``ok`` (exit 0, summary completed, every step in metrics.jsonl) or ``crash``
with the evidence: the exit status, the signal of a rank (from the launcher's report), and the
first line of train.log that names a glibc or Python fatal error. The report is printed as a table
and written to OUT/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FATAL = re.compile(
    r"double free|free\(\): |malloc\(\)|corrupted|Fatal Python error|Segmentation fault|SIGSEGV|SIGABRT|"
    r"exitcode\s*:\s*-\d+|Signal \d+|core dumped",
    re.IGNORECASE,
)


def make_inputs(out: Path) -> tuple[Path, Path]:
    from rlctl.testing import build_tiny_model

    model = out / "model"
    if not (model / "config.json").is_file():
        build_tiny_model(model, seed=0)
    rng = random.Random(0)
    rows = []
    for _ in range(64):
        a, b = rng.randrange(0, 100, 3), rng.randrange(0, 100, 7)
        rows.append({"prompt": f"What is {a} + {b}?", "answer": str(a + b)})
    data = out / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def one_run(args, model: Path, data: Path, run_dir: Path) -> dict:
    argv = [
        sys.executable,
        "-m",
        "rlctl",
        "grpo",
        "--model",
        str(model),
        "--data",
        str(data),
        "--output-dir",
        str(run_dir),
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--rollout",
        "hf",
        "--batch-size",
        "4",
        "--n",
        "4",
        "--max-prompt-len",
        "48",
        "--max-response-len",
        "8",
        "--lr",
        "1e-3",
        "--reward",
        f"{REPO / 'tests' / 'support' / 'rl_rewards.py'}:digits",
        "--max-steps",
        str(args.steps),
        "--set",
        f"checkpoint.save_every={args.save_every}",
        "--set",
        "checkpoint.keep_last=2",
    ]
    env = dict(os.environ, MALLOC_CHECK_="3", PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    start = time.time()
    res = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    seconds = time.time() - start
    log = run_dir / "train.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    summary_file = run_dir / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    steps = set()
    if (run_dir / "metrics.jsonl").is_file():
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") != "eval" and "step" in rec:
                steps.add(rec["step"])
    fatal = next((line.strip() for line in (text + res.stderr).splitlines() if FATAL.search(line)), "")
    ok = res.returncode == 0 and summary.get("status") == "completed" and len(steps) >= 1 and not fatal
    return {
        "run": run_dir.name,
        "status": "ok" if ok else "crash",
        "returncode": res.returncode,
        "seconds": round(seconds, 1),
        "final_step": summary.get("step"),
        "evidence": fatal or ("" if ok else (res.stderr.strip().splitlines() or [""])[-1][:300]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--keep", action="store_true", help="keep each run's directory (default: only crashed ones)")
    args = parser.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    try:  # a core file for a crashing rank, where the system writes them
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        pass
    model, data = make_inputs(out)
    results = []
    for i in range(args.runs):
        run_dir = out / f"run_{i:03d}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        r = one_run(args, model, data, run_dir)
        results.append(r)
        print(f"{r['run']}: {r['status']} rc={r['returncode']} {r['seconds']}s step={r['final_step']} {r['evidence']}")
        sys.stdout.flush()
        if r["status"] == "ok" and not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        (out / "soak.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    crashes = sum(r["status"] != "ok" for r in results)
    print(f"{len(results)} runs x {args.steps} steps (save every {args.save_every}): {crashes} crashed")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
