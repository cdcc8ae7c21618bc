"""`rlctl eval` measured, for benchmarks/gpu_check.sh (step `eval-hf`): one real command, timed from outside.

    python benchmarks/eval_gpu_check.py --model Qwen2.5-0.5B --out DIR [--device cuda] [--prompts 16 --n 4]

The model is a benchmark model (:func:`rlctl.bench.models.resolve_bench_model`: ``tiny``, a local HF directory,
or a catalog name, whose random weights are written to disk once, as `rlctl eval` loads its model from files).
The prompts are random text of about ``--prompt-len`` tokens, scored by the built-in ``length`` reward. The
command runs as a child process (``python -m rlctl eval MODEL --data ... --json -o samples.jsonl``) while
:class:`rlctl.bench.common.ProcessSampler` samples the memory it holds: on CUDA each GPU's memory in use
(nvidia-smi, the CUDA context included) less its use before; on CPU the process's RSS. Printed: one JSON object
in the shape of `rlctl bench train --json` (``results[0]``: ``time_s``, ``tokens_per_s``, ``memory``) that
benchmarks/gpu_check_table.py renders; `rlctl estimate` has no eval method, so no estimate stands beside it.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from rlctl.bench.common import ProcessSampler, envelope
from rlctl.bench.models import resolve_bench_model, token_space
from rlctl.bench.train import random_text
from rlctl.errors import UserError


def is_eval(cmdline: list[str]) -> bool:
    return "rlctl" in cmdline and "eval" in cmdline


def write_prompts(model_path: Path, path: Path, prompts: int, prompt_len: int, seed: int = 0) -> Path:
    allowed, tok = token_space(model_path)
    rng = random.Random(seed)
    rows = [
        {"prompt": random_text(tok, allowed, prompt_len, rng), "answer": "", "extra_info": {"target_length": 8}}
        for _ in range(prompts)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_eval(args) -> dict:
    model = resolve_bench_model(args.model, random_init=args.model != "tiny")
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    data = write_prompts(model.path, out / "prompts.jsonl", args.prompts, args.prompt_len)
    cmd = [sys.executable, "-m", "rlctl", "eval", str(model.path), "--data", str(data), "--n", str(args.n)]
    cmd += ["--temperature", "1.0", "--max-new-tokens", str(args.max_new_tokens), "--reward", "length"]
    cmd += ["--device", args.device, "--json", "-o", str(out / "samples.jsonl")]
    start = time.perf_counter()
    with ProcessSampler(is_eval, gpu=args.device == "cuda") as sampler:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"rlctl eval failed (exit {proc.returncode}): {' '.join(cmd)}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = max(sampler.peak.values(), default=0)
    memory = {
        "source": "nvidia-smi memory.used less its use before" if args.device == "cuda" else "psutil RSS, sampled",
        "samples": sampler.samples,
        "measured_bytes": peak,
        "estimated_bytes": None,
        "torch_allocated_peak_bytes": summary.get("torch_allocated_peak_bytes"),
        "torch_reserved_peak_bytes": summary.get("torch_reserved_peak_bytes"),
    }
    row = {
        "method": "eval",
        "model": args.model,
        "device": args.device,
        "command": " ".join(cmd),
        "time_s": {"step": summary["generate_s"], "command": wall},
        "tokens_per_s": summary["tokens_per_s"],
        "tokens_per_step": summary["response_tokens"],
        "memory": memory,
        "eval": summary,
    }
    return envelope("eval", vars(args), [row])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="Qwen2.5-0.5B", help="tiny, a local HF directory, or a catalog name")
    ap.add_argument("--out", required=True, help="where the prompts, samples.jsonl go")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    try:
        print(json.dumps(run_eval(ap.parse_args()), indent=1))
    except UserError as e:  # one line and exit 2, as rlctl's commands say it
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
