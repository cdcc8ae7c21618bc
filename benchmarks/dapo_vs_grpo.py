"""The `dapo` preset against plain GRPO on the demo task: reward per generated sample (issue 26).

    python benchmarks/dapo_vs_grpo.py [--out runs/dapo_vs_grpo] [--seeds 0,1,2] [--steps 40] [--nproc 2]
                                      [--dapo-mini-batch M] [--grpo-mini-batch M]
    python benchmarks/dapo_vs_grpo.py --from-results benchmarks/results/dapo_vs_grpo.json --out /tmp/x

1. The demo's model and data (:mod:`rlctl.demo`, full size): a tiny Qwen2 trained from scratch by SFT on a
   sloppy teacher's two-digit additions (most carries forgotten), once.
2. From that model, for each seed, two `rlctl grpo` runs with the demo's GRPO settings (32 prompts x 8
   samples a step, lr 1e-4, temperature 1, no KL, exact-match reward, answers of at most 4 tokens, held-out
   greedy accuracy every 5 steps):
   - ``grpo``: the grpo defaults (ppo loss, clip 0.2 / 0.2, token-mean);
   - ``dapo``: ``--preset dapo`` (clip 0.2 / 0.28, token-mean, no KL, dynamic sampling, at most 10 rounds),
     the sizes above from the command line (they win over the preset's), and the soft overlong buffer off
     (``algo.overlong_buffer=0``: 4-token answers leave no room for DAPO's 4096-token buffer).
   Both take one optimizer step a rollout step unless ``--dapo-mini-batch M`` / ``--grpo-mini-batch M``
   give that run kind mini-batches of M prompts (32 / M updates a step; its run directories are named
   ``KIND-mbM-seedS``), as the preset's own 512 prompts in mini-batches of 32 do.
3. Samples are counted as generated: a dapo step counts every round (``dynamic/generated_samples``), the
   dropped groups' samples included. The budget is what grpo generates in ``--steps`` steps; dapo runs the
   same number of steps (it generates more) and is compared up to the budget. Reported per seed and run:
   the mean training reward of the samples generated in each quarter of the budget and over all of it
   (reward per generated sample), the least-squares slope of the per-step reward against the samples
   generated so far (per 1000 samples, within the budget), and the held-out accuracy at equal samples: at
   the budget and averaged over 8 equally spaced sample counts up to it (grpo's evaluations), read off the
   straight lines between a run's evaluations (dapo's fall at other sample counts), beside the last
   evaluation within the budget.
4. Over the seeds, paired: each measure's mean per run kind, the mean difference dapo - grpo with its
   standard error, and the seeds on which dapo's is at least grpo's. The results go to
   ``OUT/results.json`` and markdown tables to stdout; ``--from-results R`` summarises the curves of a
   results.json again without running anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from make_benchmarks_md import table as markdown_table

from rlctl import demo
from rlctl.metrics import read_metrics

EVAL_EVERY = 5
EVAL_POINTS = 8  # equally spaced sample counts up to the budget: grpo's evaluations (40 steps / 5)
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


def run_args(
    kind: str, out: Path, model: Path, data: Path, *, seed: int, steps: int, nproc: int, mini_batch: int | None = None
) -> list[str]:
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
    if mini_batch:  # prompts per optimizer step: batch / mini_batch updates a step
        args += ["--set", f"algo.mini_batch_size={mini_batch}"]
    return args


def run_name(kind: str, seed: int, mini_batch: int | None) -> str:
    """``grpo-seed0``; with mini-batches ``grpo-mb8-seed0``."""
    return f"{kind}-mb{mini_batch}-seed{seed}" if mini_batch else f"{kind}-seed{seed}"


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


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """y at ``x`` on the straight lines between ``points`` ((x, y), x ascending); None outside them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1 + 1e-9:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[0][1] if points and abs(points[0][0] - x) < 1e-9 else None


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ``ys`` against ``xs``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))


def summarise(steps: list[dict], evals: list[dict], budget: float) -> dict:
    """Reward per generated sample in each quarter of the budget and over it, the slope, the held-out
    accuracy at equal samples: at the budget and averaged over ``EVAL_POINTS`` equally spaced sample
    counts up to it (both read off the straight lines between evaluations), and at the last evaluation
    within the budget."""
    quarters = []
    for q in range(4):
        lo, hi = budget * q / 4, budget * (q + 1) / 4
        inside = [s for s in steps if lo < s["samples"] <= hi + 1e-9]
        n = sum(s["generated"] for s in inside)
        quarters.append(sum(s["reward"] * s["generated"] for s in inside) / n if n else float("nan"))
    within = [s for s in steps if s["samples"] <= budget + 1e-9]
    points = [(e["samples"], e["acc"]) for e in evals]
    at = [interpolate(points, budget * k / EVAL_POINTS) for k in range(1, EVAL_POINTS + 1)]
    acc = [e for e in evals if e["samples"] <= budget + 1e-9]
    return {
        "quarters": quarters,
        "reward_in_budget": sum(s["reward"] * s["generated"] for s in within) / sum(s["generated"] for s in within),
        "slope_per_1k": slope([s["samples"] / 1000 for s in within], [s["reward"] for s in within]),
        "acc_start": evals[0]["acc"] if evals else None,
        "acc_at_budget": at[-1],
        "acc_mean_in_budget": sum(at) / len(at) if None not in at else None,
        "acc_in_budget": acc[-1]["acc"] if acc else None,
        "acc_in_budget_step": acc[-1]["step"] if acc else None,
        "steps_in_budget": len(within),
        "acc_end": evals[-1]["acc"] if evals else None,
        "samples_end": steps[-1]["samples"],
        "dropped_groups": sum(s["dropped"] for s in steps),
        "padded_groups": sum(s["padded"] for s in steps),
        "mean_rounds": sum(s["rounds"] for s in steps) / len(steps),
    }


PAIRED = {
    "slope_per_1k": "reward slope / 1k samples",
    "last_quarter": "reward / sample, last budget quarter",
    "reward_in_budget": "reward / sample, whole budget",
    "acc_at_budget": "held-out acc at the budget",
    "acc_mean_in_budget": "held-out acc, mean over the budget",
    "acc_end": "held-out acc after all steps (equal steps, not samples)",
}


def paired(results: dict) -> dict:
    """For each measure of :data:`PAIRED`, over the seeds: each run kind's mean, the mean paired difference
    dapo - grpo with its standard error (the differences' sample standard deviation / sqrt(seeds)), and the
    seeds on which dapo's is at least grpo's."""
    out = {}
    for key in PAIRED:

        def value(s: dict, key: str = key) -> float:
            return s["quarters"][3] if key == "last_quarter" else s[key]

        g = [value(r["grpo"]) for r in results["seeds"].values()]
        d = [value(r["dapo"]) for r in results["seeds"].values()]
        diff = [b - a for a, b in zip(g, d)]
        k = len(diff)
        mean = sum(diff) / k
        sd = math.sqrt(sum((x - mean) ** 2 for x in diff) / (k - 1)) if k > 1 else float("nan")
        out[key] = {
            "grpo": sum(g) / k,
            "dapo": sum(d) / k,
            "diff": mean,
            "se": sd / math.sqrt(k),
            "dapo_ge_grpo": sum(x >= 0 for x in diff),
            "seeds": k,
        }
    return out


def paired_table(summary: dict) -> str:
    header = ["measure (at equal generated samples unless said)", "grpo", "dapo", "dapo - grpo, mean +- s.e.",
              "seeds dapo >= grpo"]  # fmt: skip
    rows = [
        [
            PAIRED[key],
            f"{p['grpo']:.4f}",
            f"{p['dapo']:.4f}",
            f"{p['diff']:+.4f} +- {p['se']:.4f}",
            f"{p['dapo_ge_grpo']} of {p['seeds']}",
        ]
        for key, p in summary.items()
    ]
    return markdown_table(header, rows)


def table(results: dict) -> str:
    header = ["seed", "run", "reward / sample, budget quarters 1-4", "slope / 1k samples",
              "held-out acc: start -> at budget, mean over budget", "last eval in budget (step)", "steps in budget",
              "rounds / step", "dropped / padded groups", "samples, acc after all steps"]  # fmt: skip
    rows = [
        [
            seed,
            kind,
            " / ".join(f"{x:.3f}" for x in s["quarters"]),
            f"{s['slope_per_1k']:+.4f}",
            f"{s['acc_start']:.3f} -> {s['acc_at_budget']:.3f}, {s['acc_mean_in_budget']:.3f}",
            f"{s['acc_in_budget']:.3f} ({s['acc_in_budget_step']})",
            str(s["steps_in_budget"]),
            f"{s['mean_rounds']:.2f}",
            f"{s['dropped_groups']:.0f} / {s['padded_groups']:.0f}",
            f"{s['samples_end']:.0f}, {s['acc_end']:.3f}",
        ]
        for seed, runs in results["seeds"].items()
        for kind, s in runs.items()
    ]
    return markdown_table(header, rows)


def seed_table(results: dict) -> str:
    """One row a seed, grpo / dapo side by side."""
    header = ["seed", "slope / 1k samples, grpo / dapo", "reward / sample in the last budget quarter",
              "held-out acc at the budget", "held-out acc, mean over the budget",
              "dapo: rounds / step, groups dropped / step, samples / step"]  # fmt: skip
    steps = results["steps"]
    rows = [
        [
            seed,
            f"{g['slope_per_1k']:+.4f} / {d['slope_per_1k']:+.4f}",
            f"{g['quarters'][3]:.3f} / {d['quarters'][3]:.3f}",
            f"{g['acc_at_budget']:.3f} / {d['acc_at_budget']:.3f}",
            f"{g['acc_mean_in_budget']:.3f} / {d['acc_mean_in_budget']:.3f}",
            f"{d['mean_rounds']:.2f}, {d['dropped_groups'] / steps:.1f}, {d['samples_end'] / steps:.0f}",
        ]
        for seed, g, d in ((seed, runs["grpo"], runs["dapo"]) for seed, runs in results["seeds"].items())
    ]
    return markdown_table(header, rows)


def run_seeds(out: Path, seeds: list[int], steps: int, nproc: int, mini_batch: dict[str, int | None]) -> dict:
    """The SFT model once, then both runs of each seed (a run whose directory holds a summary is read,
    not rerun), each run kind with its ``mini_batch`` (None: the whole batch, one update a step); every
    run's curve and wall seconds."""
    base, data, sft = out / "base", out / "data", out / "sft"
    if not (sft / "hf" / "config.json").is_file():
        demo.build_model(base, demo.FULL)
        demo.write_data(data, demo.FULL)
        sft_args = demo.sft_args(sft, base, data / "sft.jsonl", demo.FULL, nproc=nproc, seed=demo.SEED)
        print(f"sft: {rlctl('sft', sft_args, out / 'sft.log'):.0f}s", flush=True)
    per_step = demo.FULL.grpo_batch * demo.FULL.grpo_n
    results: dict = {"per_step": per_step, "steps": steps, "mini_batch": mini_batch, "seconds": {}, "curves": {}}
    for seed in seeds:
        for kind in ("grpo", "dapo"):
            name = run_name(kind, seed, mini_batch[kind])
            run = out / name
            if not (run / "summary.json").is_file():
                a = run_args(
                    kind, run, sft / "hf", data, seed=seed, steps=steps, nproc=nproc, mini_batch=mini_batch[kind]
                )
                secs = rlctl("grpo", a, out / f"{name}.log")
                results["seconds"][name] = secs
                print(f"{name}: {secs:.0f}s", flush=True)
            results["curves"].setdefault(str(seed), {})[kind] = curve(run, per_step)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/dapo_vs_grpo"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=demo.FULL.grpo_steps)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--from-results", type=Path, help="summarise the curves of this results.json; run nothing")
    for kind in ("dapo", "grpo"):
        parser.add_argument(f"--{kind}-mini-batch", type=int, help=f"prompts per optimizer step of the {kind} runs "
                            "(default: the whole batch, one update a step)")  # fmt: skip
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.from_results:
        results = json.loads(args.from_results.read_text())
    else:
        mini_batch = {"grpo": args.grpo_mini_batch, "dapo": args.dapo_mini_batch}
        results = run_seeds(out, [int(s) for s in args.seeds.split(",")], args.steps, args.nproc, mini_batch)
    results["seeds"] = {}
    for seed, curves in results["curves"].items():
        budget = curves["grpo"][0][-1]["samples"]
        results["seeds"][seed] = {kind: summarise(*curves[kind], budget) for kind in ("grpo", "dapo")}
    results["paired"] = paired(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    print()
    print(seed_table(results))
    print()
    print(paired_table(results["paired"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
