"""The figures of stored gpu_check.sh runs as a markdown table (docs/benchmarks.md's GPU section).

    python benchmarks/gpu_check_table.py benchmarks/results/gpu_check/run*_h200.json

Per step: status and seconds; for `rlctl bench train` steps the median step time (the first step, a warm-up,
left out), tokens/s, MFU against the catalog's dense bf16 peak, and the peak memory measured (nvidia-smi, and
torch's allocated / reserved peaks) beside the plan's estimate.
"""

from __future__ import annotations

import json
import sys

GB = 1e9


def gb(x) -> str:
    return f"{x / GB:.2f}" if isinstance(x, (int, float)) else "-"


def rows(path: str) -> list[str]:
    doc = json.load(open(path))
    out = []
    for s in doc["steps"]:
        if s["status"] == "skipped":
            continue
        res = (s.get("result") or {}).get("results") or [None]
        r = res[0] or {}
        m = r.get("memory") or {}
        err = m.get("relative_error")
        cells = [
            s["step"],
            s["status"],
            f"{s['seconds']:.0f}",
            f"{r['time_s']['step']:.2f}" if r.get("time_s") else "-",
            f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") else "-",
            f"{100 * r['mfu']:.2f}%" if r.get("mfu") else "-",
            f"{gb(m.get('measured_bytes'))} / {gb(m.get('estimated_bytes'))}"
            + (f" ({100 * err:+.0f}%)" if err else ""),
            f"{gb(m.get('torch_allocated_peak_bytes'))} / {gb(m.get('estimated_allocated_bytes'))}",
            f"{gb(m.get('torch_reserved_peak_bytes'))} / {gb(m.get('estimated_reserved_bytes'))}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main() -> None:
    print(
        "| step | status | s | step time (s) | tokens/s | MFU | GPU peak GB: nvidia-smi / estimate "
        "| torch allocated / est. | torch reserved / est. |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        print("\n".join(rows(path)))


if __name__ == "__main__":
    main()
