"""Wall time of `rlctl --help` (target: under 0.3 s), `rlctl --version` and a refusal before launch (a data
file with no rows), against a bare `python -c pass` in the same run.

    python benchmarks/cli_startup.py [--runs 10]

Also checks that the help path imports no heavy module (torch, transformers, vllm), and which modules
`rlctl --version` imports beyond Python's own start-up (issue 37: none of typer, rich, yaml, rlctl.cli).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(argv: list[str], runs: int, check: bool = True) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        "rlctl --version": [sys.executable, "-m", "rlctl", "--version"],
    }
    print(f"python -c pass: {bare * 1000:.0f} ms (median of {args.runs})")
    for name, argv in cases.items():
        t = timed(argv, args.runs, check=True)
        print(
            f"{name}: {t * 1000:.0f} ms  ({t / bare:.1f}x bare python)  {'OK' if t < 0.3 else 'over the 0.3 s target'}"
        )
    probe = (
        "import sys; import rlctl.cli.app; "
        "print(sorted(m for m in ('torch','transformers','vllm','datasets','peft') if m in sys.modules))"
    )
    heavy = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip()
    print(f"heavy modules imported by the CLI: {heavy}")
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.jsonl"
        empty.write_text("")
        refused = [sys.executable, "-m", "rlctl", "sft", "--model", "Qwen2.5-7B", "--device", "cpu"]
        refused += ["--data", str(empty), "-o", str(Path(tmp) / "run")]
        t = timed(refused, args.runs, check=False)
        print(f"rlctl sft ... --data empty.jsonl (refused before launch): {t * 1000:.0f} ms ({t / bare:.1f}x bare)")
    probe = (
        "import sys\nsys.argv = ['rlctl', '--version']\nfrom rlctl.cli.app import main\ntry:\n    main()\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in ('typer', 'rich', 'yaml', 'click', 'rlctl.cli.train') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split("\n")
    print(f"imported by rlctl --version: {out[1] if len(out) > 1 else out}")


if __name__ == "__main__":
    main()
