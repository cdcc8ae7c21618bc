"""The `dapo` preset against plain GRPO on the demo task: reward per generated sample (issue 26).

    python benchmarks/dapo_vs_grpo.py [--out runs/dapo_vs_grpo] [--seeds 0,1,2] [--steps 40] [--nproc 2]

1. The demo's model and data (:mod:`rlctl.demo`, full size): a tiny Qwen2 trained from scratch by SFT on a
   sloppy teacher's two-digit additions (most carries forgotten), once.
2. From that model, for each seed, two `rlctl grpo` runs with the demo's GRPO settings (32 prompts x 8
   samples a step, lr 1e-4, temperature 1, no KL, exact-match reward, answers of at most 4 tokens, held-out
   greedy accuracy every 5 steps):
   - ``grpo``: the grpo defaults (ppo loss, clip 0.2 / 0.2, token-mean);
   - ``dapo``: ``--preset dapo`` (clip 0.2 / 0.28, token-mean, no KL, dynamic sampling, at most 10 rounds),
     the sizes above from the command line (they win over the preset's), and the soft overlong buffer off
     (``algo.overlong_buffer=0``: 4-token answers leave no room for DAPO's 4096-token buffer).
3. Samples are counted as generated: a dapo step counts every round (``dynamic/generated_samples``). The
   budget is what grpo generates in ``--steps`` steps; dapo runs the same number of steps (it generates
   more) and is compared up to the budget. Reported per seed and run: the mean training reward of the
   samples generated in each quarter of the budget (reward per generated sample), the least-squares slope
   of the per-step reward against the samples generated so far (per 1000 samples, within the budget), and
   the held-out accuracy at the last evaluation within the budget. The results go to ``OUT/results.json``
   and a markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rlctl import demo
from rlctl.metrics import read_metrics

EVAL_EVERY = 5
MAX_ROUNDS = 10


def rlctl(method: str, args: list[str], log: Path) -> float:
    """``python -m rlctl METHOD ARGS``, its output to ``log``; returns the wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.call([sys.executable, "-m", "rlctl", method, *args], env=env, stdout=f, stderr=f)
    if code != 0:
        raise SystemExit(f"rlctl {method} failed ({code}); see {log}")
    return time.perf_counter() - began


def run_args(kind: str, out: Path, model: Path, data: Path, *, seed: int, steps: int, nproc: int) -> list[str]:
    size = demo.FULL
    args = demo.grpo_args(
        out,
        model,
        data / "rl.jsonl",
        size,
        nproc=nproc,
        seed=seed,
        rollout="hf",
        val=data / "heldout.jsonl",
    )
    args[args.index("--max-steps") + 1] = str(steps)
    args += ["--set", f"train.eval_every={EVAL_EVERY}", "--set", "checkpoint.export_hf=false"]
    if kind == "dapo":
        args += [
            "--preset",
            "dapo",
            "--set",
            "algo.overlong_buffer=0",
            "--set",
            f"algo.dynamic_max_rounds={MAX_ROUNDS}",
        ]
    return args


def curve(run: Path, per_step: int) -> tuple[list[dict], list[dict]]:
    """(steps: {step, samples (cumulative), reward, rounds, kept, dropped}, evals: {step, samples, acc})."""
    records = read_metrics(run / "metrics.jsonl")
    steps, total, at = [], 0.0, {0: 0.0}
    for r in records:
        if r.get("kind") == "eval":
            continue
        generated = r.get("dynamic/generated_samples", per_step)
        total += generated
        at[r["step"]] = total
        steps.append(
            {
                "step": r["step"],
                "samples": total,
                "generated": generated,
                "reward": r["reward/mean"],
                "rounds": r.get("dynamic/rounds", 1.0),
                "kept": r.get("dynamic/kept_groups"),
                "dropped": r.get("dynamic/dropped_groups", 0.0),
                "padded": r.get("dynamic/padded_groups", 0.0),
            }
        )
    evals = [
        {"step": r["step"], "samples": at[r["step"]], "acc": r["val/acc"]} for r in records if r.get("kind") == "eval"
    ]
    return steps, evals


def summarise(steps: list[dict], evals: list[dict], budget: float) -> dict:
    """Reward per generated sample in each quarter of the budget, the slope, the accuracy within budget."""
    quarters = []
    for q in range(4):
        lo, hi = budget * q / 4, budget * (q + 1) / 4
        inside = [s for s in steps if lo < s["samples"] <= hi + 1e-9]
        n = sum(s["generated"] for s in inside)
        quarters.append(sum(s["reward"] * s["generated"] for s in inside) / n if n else float("nan"))
    within = [s for s in steps if s["samples"] <= budget + 1e-9]
    xs, ys = [s["samples"] / 1000 for s in within], [s["reward"] for s in within]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
    acc = [e for e in evals if e["samples"] <= budget + 1e-9]
    return {
        "quarters": quarters,
        "slope_per_1k": slope,
        "acc_start": evals[0]["acc"] if evals else None,
        "acc_in_budget": acc[-1]["acc"] if acc else None,
        "acc_in_budget_step": acc[-1]["step"] if acc else None,
        "steps_in_budget": len(within),
        "acc_end": evals[-1]["acc"] if evals else None,
        "samples_end": steps[-1]["samples"],
        "dropped_groups": sum(s["dropped"] for s in steps),
        "padded_groups": sum(s["padded"] for s in steps),
        "mean_rounds": sum(s["rounds"] for s in steps) / len(steps),
    }


def table(results: dict) -> str:
    lines = [
        "| seed | run | reward / sample, budget quarters 1-4 | slope / 1k samples | held-out acc: start -> in budget "
        "(step) | steps in budget | rounds / step | dropped / padded groups | samples, acc after all steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, runs in results["seeds"].items():
        for kind, s in runs.items():
            q = " / ".join(f"{x:.3f}" for x in s["quarters"])
            lines.append(
                f"| {seed} | {kind} | {q} | {s['slope_per_1k']:+.4f} | {s['acc_start']:.3f} -> "
                f"{s['acc_in_budget']:.3f} ({s['acc_in_budget_step']}) | {s['steps_in_budget']} | "
                f"{s['mean_rounds']:.2f} | {s['dropped_groups']:.0f} / {s['padded_groups']:.0f} | "
                f"{s['samples_end']:.0f}, {s['acc_end']:.3f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/dapo_vs_grpo"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=demo.FULL.grpo_steps)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    base, data, sft = out / "base", out / "data", out / "sft"
    if not (sft / "hf" / "config.json").is_file():
        demo.build_model(base, demo.FULL)
        demo.write_data(data, demo.FULL)
        sft_args = demo.sft_args(sft, base, data / "sft.jsonl", demo.FULL, nproc=args.nproc, seed=demo.SEED)
        print(f"sft: {rlctl('sft', sft_args, out / 'sft.log'):.0f}s", flush=True)
    per_step = demo.FULL.grpo_batch * demo.FULL.grpo_n
    results: dict = {"per_step": per_step, "steps": args.steps, "seeds": {}, "seconds": {}}
    for seed in [int(s) for s in args.seeds.split(",")]:
        curves = {}
        for kind in ("grpo", "dapo"):
            run = out / f"{kind}-seed{seed}"
            if not (run / "summary.json").is_file():
                a = run_args(kind, run, sft / "hf", data, seed=seed, steps=args.steps, nproc=args.nproc)
                secs = rlctl("grpo", a, out / f"{kind}-seed{seed}.log")
                results["seconds"][f"{kind}-seed{seed}"] = secs
                print(f"{kind} seed {seed}: {secs:.0f}s", flush=True)
            curves[kind] = curve(run, per_step)
        budget = curves["grpo"][0][-1]["samples"]
        results["seeds"][seed] = {kind: summarise(*curves[kind], budget) for kind in curves}
        results["curves"] = {**results.get("curves", {}), str(seed): curves}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
