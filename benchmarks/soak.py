"""Soak: the same 2-process GRPO run (tiny model, HF rollout, CPU) N times; does any run crash?

    python benchmarks/soak.py [--runs 5] [--steps 300] [--save-every 25] [--out runs/soak]

A glibc "double free" was once seen in about 1 of 10 40-step CPU runs and never reproduced; this
repeats a long run with periodic checkpoints (each save is a DCP write, a rename and a prune) under
glibc's heap checking (``MALLOC_CHECK_=3``: a heap corruption aborts at once, at the faulty call,
instead of later) and Python's faulthandler (``PYTHONFAULTHANDLER=1``: the Python stack of every
thread on SIGSEGV/SIGABRT goes to train.log). glibc 2.34 and later read ``MALLOC_CHECK_`` only when
``libc_malloc_debug.so.0`` is preloaded: it is, when found (``--no-malloc-debug`` to run without it;
glibc's default checks, e.g. "free(): double free detected in tcache 2", apply either way). Core
dumps are allowed (``ulimit -c unlimited``) when the system lets them be written.

``--kills K`` instead soaks resume: an uninterrupted 2-process SFT run (tiny model, checkpoint every
2 steps) is the reference; then each of N trials kills a random rank at K random points (``RLCTL_FAULT``:
after a step, inside a save after the DCP write, before the rename, before ``latest``, mid-prune),
resuming with ``--resume auto`` after each kill, and compares the final exported weights with the
reference's (tensor by tensor, within 1e-6) and checks every ``step_N`` directory left after each
kill is whole.

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
    from tests.support.rl import arith_rows
    from tests.support.sft import write_jsonl

    model = out / "model"
    if not (model / "config.json").is_file():
        build_tiny_model(model, seed=0)
    return model, write_jsonl(out / "prompts.jsonl", arith_rows(64, seed=0))


def one_run(args, model: Path, data: Path, run_dir: Path) -> dict:
    from tests.support.rl import REWARDS

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
        f"{REWARDS}:digits",
        "--max-steps",
        str(args.steps),
        "--set",
        f"checkpoint.save_every={args.save_every}",
        "--set",
        "checkpoint.keep_last=2",
    ]
    env = dict(os.environ, MALLOC_CHECK_="3", PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if args.malloc_debug:  # glibc >= 2.34 reads MALLOC_CHECK_ only with its debug malloc preloaded
        env["LD_PRELOAD"] = args.malloc_debug
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


def _sft(model: Path, data: Path, run_dir: Path, steps: int, *, resume: bool, fault: str = ""):
    argv = [sys.executable, "-m", "rlctl", "sft", "--model", str(model), "--data", str(data)]
    argv += ["--output-dir", str(run_dir), "--device", "cpu", "--nproc", "2"] + (["--resume", "auto"] if resume else [])
    sets = {
        "train.max_len": 96,
        "train.batch_size": 8,
        "train.lr": 3e-3,
        "train.warmup_ratio": 0.0,
        "train.max_steps": steps,
        "model.attn": "sdpa",
        "model.dtype": "fp32",
        "checkpoint.save_every": 2,
        "checkpoint.keep_last": 2,
    }
    for key, value in sets.items():
        argv += ["--set", f"{key}={value}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), RLCTL_FAULT=fault)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)


def _weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted((run_dir / "hf").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def kill_trials(args, out: Path) -> list[dict]:
    from rlctl.runtime.checkpoint import FAULT_POINTS
    from rlctl.runtime.layout import checkpoint_problem
    from tests.support.sft import chat_rows, write_jsonl

    model, _ = make_inputs(out)
    data = write_jsonl(out / "chat.jsonl", chat_rows(40))
    steps = args.steps
    reference = out / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    res = _sft(model, data, reference, steps, resume=False)
    if res.returncode != 0:
        raise SystemExit(f"the reference run failed:\n{res.stderr[-3000:]}")
    want = _weights(reference)
    rng = random.Random(args.seed)
    results = []
    for i in range(args.runs):
        run_dir = out / f"kill_{i:03d}"
        shutil.rmtree(run_dir, ignore_errors=True)
        faults, broken, last = [], [], None
        for k in range(args.kills):
            point = rng.choice(FAULT_POINTS)
            first = 6 if point == "prune" else 2  # with keep_last 2, the save of step 6 prunes step 2 first
            step = rng.randrange(1, steps + 1) if point == "step" else rng.randrange(first, steps + 1, 2)
            rank = rng.randrange(2) if point in ("step", "write") else 0  # rank 0 renames and prunes
            fault = f"{point}:{step}:{rank}"
            last = _sft(model, data, run_dir, steps, resume=k > 0, fault=fault)
            faults.append(f"{fault}->{'killed' if last.returncode else 'not reached'}")
            ckpts = run_dir / "checkpoints"
            for d in sorted(ckpts.glob("step_*")) if ckpts.is_dir() else []:
                if problem := checkpoint_problem(d):
                    broken.append(problem)
            if last.returncode == 0:
                break
        if last is None or last.returncode != 0:
            last = _sft(model, data, run_dir, steps, resume=True)
        diff = None
        if last.returncode == 0:
            got = _weights(run_dir)
            diff = max((got[k].double() - want[k].double()).abs().max().item() for k in want) if got else None
        ok = last.returncode == 0 and not broken and diff is not None and diff <= 1e-6
        results.append(
            {
                "run": run_dir.name,
                "status": "ok" if ok else "FAILED",
                "faults": faults,
                "max_weight_diff": diff,
                "half_visible": broken,
                "evidence": "" if last.returncode == 0 else (last.stderr.strip().splitlines() or [""])[-1][:300],
            }
        )
        r = results[-1]
        print(f"{r['run']}: {r['status']} {' '.join(faults)} max|dw|={diff} {r['evidence']}", flush=True)
        if ok and not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
        (out / "kills.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=2) + "\n")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--keep", action="store_true", help="keep each run's directory (default: only crashed ones)")
    parser.add_argument("--kills", type=int, default=0, help="SFT resume soak: random kills per trial")
    parser.add_argument("--no-malloc-debug", dest="malloc_debug", action="store_false")
    parser.add_argument("--seed", type=int, default=0, help="of the random kill points")
    args = parser.parse_args()
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    found = [
        p
        for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")
        for p in Path(d).glob("libc_malloc_debug.so*")
    ]
    args.malloc_debug = str(found[0]) if args.malloc_debug and found else ""
    if args.kills:
        results = kill_trials(args, out)
        failed = sum(r["status"] != "ok" for r in results)
        print(f"{len(results)} trials x up to {args.kills} kills ({args.steps} steps): {failed} failed")
        return 1 if failed else 0
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
