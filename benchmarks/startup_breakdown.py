"""Where the seconds of a short run go (issue 37, item 15): a 2-step GRPO run of the tiny model on CPU,
and each start-up part timed on its own in fresh processes.

    python benchmarks/startup_breakdown.py [--nproc 2] [--runs 3]

Parts (medians of ``--runs``): a bare interpreter; the imports a rank makes (torch, transformers, the grpo
recipe); torchrun starting ``--nproc`` processes that join a gloo group and exit (rendezvous); the tiny
model's load; the launcher's checks before launch (`--dry-run` of the same job); and the whole run,
from the command to its exit, with the wall time until the ranks logged step 1 (metrics.jsonl's first
record) and the steps themselves (``time/step``). The parts are measured apart, so they overlap and do not
add up to the run exactly: what is left (the data cache, the engine set-up, the first step's warm-up) is
the difference, said as such.
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

REPO = Path(__file__).resolve().parents[1]
RENDEZVOUS = """
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""


def wall(argv: list[str], runs: int, env: dict | None = None) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env={**os.environ, **(env or {})}, cwd=REPO)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    py = sys.executable
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sys.path.insert(0, str(REPO))
        from rlctl.testing import build_tiny_model
        from tests.support.rl import arith_rows
        from tests.support.sft import write_jsonl

        model = build_tiny_model(tmp / "model", seed=0)
        data = write_jsonl(tmp / "rl.jsonl", arith_rows(32))
        (tmp / "rdzv.py").write_text(RENDEZVOUS)
        load = f"from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained({str(model)!r})"
        parts = {
            "python -c pass": wall([py, "-c", "pass"], args.runs),
            "import torch": wall([py, "-c", "import torch"], args.runs),
            "import torch, transformers (AutoModelForCausalLM)": wall(
                [py, "-c", "import torch; from transformers import AutoModelForCausalLM"], args.runs
            ),
            "import rlctl.recipes.grpo (a rank's imports)": wall(
                [py, "-c", "import rlctl.recipes.grpo"], args.runs, env
            ),
            f"torchrun: {args.nproc} processes join a gloo group and exit": wall(
                [
                    py,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc-per-node",
                    str(args.nproc),
                    str(tmp / "rdzv.py"),
                ],
                args.runs,
                env,
            ),
            "load the tiny model (import + from_pretrained)": wall(
                [py, "-c", load],
                args.runs,
            ),
        }
        job = ["grpo", "--model", str(model), "--data", str(data), "--reward", "exact", "--device", "cpu"]
        job += ["--nproc", str(args.nproc), "--max-prompt-len", "48", "--max-response-len", "12", "--batch-size", "4"]
        job += ["--n", "4", "--max-steps", "2", "--set", "checkpoint.export_hf=false", "--samples-every", "0"]
        parts["rlctl grpo ... --dry-run (resolve, plan, checks)"] = wall(
            [py, "-m", "rlctl", *job, "--dry-run"], args.runs, env
        )
        runs = []
        for i in range(args.runs):
            out = tmp / f"run{i}"
            t0 = time.time()
            subprocess.run(
                [py, "-m", "rlctl", *job, "-o", str(out)],
                check=True,
                capture_output=True,
                env={**os.environ, **env},
                cwd=REPO,
            )
            end = time.time()
            steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in steps if "step" in r and r.get("kind") != "eval"]
            first = steps[0]["time"] - steps[0].get("time/step", 0.0)  # when step 1 began
            runs.append((end - t0, first - t0, sum(r.get("time/step", 0.0) for r in steps), end - steps[-1]["time"]))
    print(f"{'part':<62} {'median s':>9}")
    for name, secs in parts.items():
        print(f"{name:<62} {secs:>9.2f}")
    total, to_step1, stepping, after = (statistics.median(x) for x in zip(*runs))
    print(f"{'the 2-step run, command to exit':<62} {total:>9.2f}")
    print(f"{'  of which: command to the start of step 1':<62} {to_step1:>9.2f}")
    print(f"{'  of which: the 2 steps (time/step)':<62} {stepping:>9.2f}")
    print(f"{'  of which: after the last step (save, exit)':<62} {after:>9.2f}")
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
