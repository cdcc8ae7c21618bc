"""Wall time of `rlctl --help` (target: under 0.3 s), against a bare `python -c pass` in the same run.

    python benchmarks/cli_startup.py [--runs 10]

Also checks that the help path imports no heavy module (torch, transformers, vllm).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def timed(argv: list[str], runs: int) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    bare = timed([sys.executable, "-c", "pass"], args.runs)
    cases = {
        "rlctl --help": [sys.executable, "-m", "rlctl", "--help"],
        "rlctl grpo --help": [sys.executable, "-m", "rlctl", "grpo", "--help"],
        "rlctl presets list": [sys.executable, "-m", "rlctl", "presets", "list"],
    }
    print(f"python -c pass: {bare * 1000:.0f} ms (median of {args.runs})")
    for name, argv in cases.items():
        t = timed(argv, args.runs)
        print(
            f"{name}: {t * 1000:.0f} ms  ({t / bare:.1f}x bare python)  {'OK' if t < 0.3 else 'over the 0.3 s target'}"
        )
    probe = (
        "import sys; import rlctl.cli.app; "
        "print(sorted(m for m in ('torch','transformers','vllm','datasets','peft') if m in sys.modules))"
    )
    heavy = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    print(f"heavy modules imported by the CLI: {heavy}")


if __name__ == "__main__":
    main()
