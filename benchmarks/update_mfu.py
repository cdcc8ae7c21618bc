"""MFU of rlctl's GRPO update in benchmarks/grpo_vs_trl.py's runs, against the fp32 matmul peak measured now.

    python benchmarks/update_mfu.py /tmp/bench-grpo --regime compute [--json benchmarks/results/speed/update-mfu.json]

Model FLOPs per rlctl.bench.mfu (PaLM's convention: 6 N + attention per token, backward = 2 x forward),
over the median ``time/update`` of the steps after warm-up. Two token counts: the logical one
(every sample's prompt + response, the convention `rlctl bench train` uses) and the executed one
(shared-prefix rows: each prompt once per group, each response but its last token). The peak: the
best rate of 1024 x 1024 fp32 matmuls in this process with one thread, measured before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

WARMUP_STEPS = 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bench_dir")
    ap.add_argument("--regime", default="compute")
    ap.add_argument("--json", default="benchmarks/results/speed/update-mfu.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).parent))
    from grpo_vs_trl import REGIMES

    from rlctl.bench import mfu as M
    from rlctl.catalog.hf_config import spec_from_path

    r = REGIMES[args.regime]
    root = Path(args.bench_dir)
    spec = spec_from_path(root / f"model-{r.hidden}x{r.layers}")
    peak = M.matmul_rate(1024, 2.0)
    runs = []
    for run in sorted(root.glob(f"{args.regime}-rlctl-*/metrics.jsonl")):
        records = [json.loads(x) for x in run.read_text().splitlines() if '"kind": "eval"' not in x]
        steady = records[WARMUP_STEPS:]
        tokens = statistics.median(x["tokens"] for x in steady)
        update_s = statistics.median(x["time/update"] for x in steady)
        samples = r.batch * r.n
        resp = statistics.median(x["response_len/mean"] for x in steady)
        prompt = (tokens - samples * resp) / samples  # tokens per prompt, chat template included
        executed = r.batch * (prompt + r.n * (resp - 1))
        seq = tokens / samples
        flops = tokens * M.train_flops_per_token(spec, seq)
        flops_exec = executed * M.train_flops_per_token(spec, seq)
        runs.append(
            {
                "run": str(run.parent),
                "tokens": tokens,
                "executed_tokens": executed,
                "update_s": update_s,
                "flops_per_s": flops / update_s,
                "executed_flops_per_s": flops_exec / update_s,
            }
        )
    peak = max(peak, M.matmul_rate(1024, 2.0))
    for x in runs:
        x["mfu"] = x["flops_per_s"] / peak
        x["mfu_executed"] = x["executed_flops_per_s"] / peak
    load = os.getloadavg()[0]
    med = {k: statistics.median(x[k] for x in runs) for k in ("mfu", "mfu_executed", "update_s")}
    print(
        f"{args.regime}: fp32 matmul peak {peak / 1e9:.1f} GFLOP/s (1 thread, load {load:.1f}); update "
        f"{med['update_s']:.2f} s, MFU {med['mfu']:.1%} (logical tokens), {med['mfu_executed']:.1%} (executed)"
    )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"regime": args.regime, "peak_flops": peak, "load": load, "median": med, "runs": runs}, indent=1)
        + "\n"
    )


if __name__ == "__main__":
    main()
