"""The figures of stored gpu_check.sh runs as a markdown table (docs/benchmarks.md's GPU section).

    python benchmarks/gpu_check_table.py benchmarks/results/gpu_check/run*_h200.json

Per step: status and seconds; for `rlctl bench train` steps the median step time (the first step, a warm-up,
left out), tokens/s, MFU against the catalog's dense bf16 peak, and the peak memory measured (nvidia-smi, and
torch's allocated / reserved peaks) beside the plan's estimate; `eval-hf` (benchmarks/eval_gpu_check.py): its
sampling time, tokens/s and peaks (no estimate). Then, where the run recorded them (G5 in docs/gpu.md), when
the nvidia-smi peak happened (seconds after the last step's record: > 0 is the final save, export or exit) and
how many processes held GPU memory then, the
device memory torch's allocator did not hold at the steps, and torch's reserved peak / the device's memory in
use after the final checkpoint save.
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
        after = (m.get("around_final_save") or {}).get("after_final_save") or {}
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
            f"{m['peak_after_last_step_s']:+.1f}" if "peak_after_last_step_s" in m else "-",
            str(len(m["processes_at_peak"])) if "processes_at_peak" in m else "-",
            gb(m.get("outside_torch_at_steps_bytes")),
            f"{gb(after.get('reserved_peak_bytes'))} / {gb(after.get('device_used_bytes'))}" if after else "-",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return out


def main() -> None:
    print(
        "| step | status | s | step time (s) | tokens/s | MFU | GPU peak GB: nvidia-smi / estimate "
        "| torch allocated / est. | torch reserved / est. | nvidia-smi peak at (s after last step) "
        "| GPU processes then "
        "| outside torch at steps GB | after final save: torch reserved peak / device used GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        print("\n".join(rows(path)))


if __name__ == "__main__":
    main()
