"""Ulysses sequence parallelism on 2 CPU processes: SFT tokens/s and peak memory per rank at sp 1 and sp 2,
beside the estimator's prediction for the same job.

    python benchmarks/sp_memory.py [--seq-len 4096] [--seqs 2] [--steps 2] [--hidden 256] [--layers 4]

A random Qwen2 (head_dim 64, GQA) is written to a temporary directory; for sp in (1, 2) a fresh
``torchrun --nproc-per-node 2`` runs the FSDP engine (gloo, fp32, sdpa, no checkpointing) on the same
global batch: ``--seqs`` sequences of ``--seq-len`` tokens per step, one sequence per micro batch (sp 1:
each rank trains its own sequence; sp 2: both ranks split each sequence). Each rank does one warm-up step
(the AdamW states come to exist), then ``--steps`` timed steps.

Memory: bytes the process has allocated with malloc and not freed (glibc ``mallinfo2``: in-use arena
chunks + mmapped chunks; torch's CPU tensors, gloo's buffers and Python's objects all come from malloc),
sampled every 0.2 ms by a thread during the timed steps. "peak" is the largest sample; "step peak" is the
peak less the in-use bytes just before the timed steps (weights, gradients and AdamW states live on
through the step, so the step peak is what activations, logits and the all-to-all buffers add): it is
what the estimator's training line counts beyond the model states. A sampler can miss a peak shorter
than its interval; the saving sp 1 -> sp 2 is what the table compares against the estimate. Peak RSS
(``ru_maxrss``) is reported beside it as a cross-check. Time is wall-clock on a shared machine.

Writes JSON (--out) and prints the table docs/benchmarks.md shows.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from make_benchmarks_md import table as markdown_table

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def heap_in_use() -> int:
    """Bytes allocated with malloc and not freed (all arenas, and mmapped chunks)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd


class PeakSampler:
    """The largest :func:`heap_in_use` seen while running (a thread sampling every ``interval`` seconds)."""

    def __init__(self, interval: float = 2e-4):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        self._mallinfo = libc.mallinfo2
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            m = self._mallinfo()
            self.peak = max(self.peak, m.uordblks + m.hblkhd)
            time.sleep(self.interval)

    def __enter__(self) -> PeakSampler:
        self.peak = heap_in_use()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, heap_in_use())


# ---------------------------------------------------------------------------------------------
# On each rank


def documents(n: int, length: int, vocab: int):
    import numpy as np

    from rlctl.data.sft import Example

    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, size=length).astype(np.int32)
        labels = np.roll(ids, -1)
        labels[-1] = -100
        out.append(Example(input_ids=ids, labels=labels))
    return out


def worker(args) -> None:
    import torch

    from rlctl.data.packing import rank_micro_batches
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.engines.spec import EngineSpec
    from rlctl.recipes.sft import token_loss_sum
    from rlctl.runtime.dist import init_distributed

    torch.set_num_threads(1)
    d = init_distributed("cpu")
    spec = EngineSpec(backend="fsdp", device="cpu", dtype="fp32", attn="sdpa", model=args.model, sp=args.sp)
    engine = FSDPEngine(spec, role="actor", total_steps=args.steps + 1)
    docs = documents(args.seqs, args.seq_len, args.vocab)
    loss_tokens = sum(int((x.labels != -100).sum()) for x in docs)
    micro = rank_micro_batches(
        docs, engine.dp_rank, engine.dp_size, packing=True, budget=args.seq_len, micro_batch_size=1, pad_id=0
    )

    def loss_fn(logits, mb):
        loss_sum = token_loss_sum(logits, mb.labels)
        return loss_sum / loss_tokens, loss_sum

    def step() -> None:
        engine.forward_backward(micro, loss_fn)
        engine.step()

    step()  # warm-up: AdamW's states exist from here on
    torch.distributed.barrier()
    before = heap_in_use()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        for _ in range(args.steps):
            step()
    torch.distributed.barrier()
    seconds = time.perf_counter() - start
    result = {
        "rank": d.rank,
        "sp": args.sp,
        "seconds": seconds,
        "tokens_per_s": args.steps * args.seqs * args.seq_len / seconds,
        "before_bytes": before,
        "peak_bytes": sampler.peak,
        "step_peak_bytes": sampler.peak - before,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    Path(args.result).with_suffix(f".rank{d.rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The driver


def build_model(out: Path, args) -> None:
    from rlctl.testing import build_tiny_model

    build_tiny_model(
        out,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        max_position_embeddings=args.seq_len,
    )


def run_sp(model: Path, sp: int, args, tmp: Path) -> list[dict]:
    result = tmp / f"sp{sp}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [__file__, "--worker", "--model", str(model), "--sp", str(sp), "--result", str(result)]
    cmd += ["--seq-len", str(args.seq_len), "--seqs", str(args.seqs), "--steps", str(args.steps)]
    cmd += ["--vocab", str(args.vocab)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    return [json.loads(result.with_suffix(f".rank{r}.json").read_text()) for r in (0, 1)]


def estimate(model: Path, sp: int, args) -> dict:
    """The estimator's training phase for this job: 2 CPU processes, fp32, no checkpointing, one sequence
    of --seq-len tokens per micro batch."""
    from rlctl.catalog.hf_config import spec_from_path
    from rlctl.catalog.spec import GpuSpec
    from rlctl.estimate import MemorySettings, estimate_memory

    settings = MemorySettings(
        method="sft", gpus=2, device="cpu", dtype="fp32", max_len=args.seq_len, micro_batch=1, sp=sp,
        activation_checkpointing=False,
    )  # fmt: skip
    cpu = GpuSpec("cpu", 2**40, 0.0, "none", 0.0, 2)
    phase = estimate_memory(spec_from_path(model), cpu, settings).phases["training"]
    states = sum(phase.components[k] for k in ("weights", "gradients", "optimizer_states"))
    return {
        "components": phase.components,
        "allocated": phase.allocated_bytes,
        "beyond_states": phase.allocated_bytes - states,
    }


def table(rows: dict) -> str:
    header = ["sp", "tokens/s (2 ranks)", "peak per rank (MiB)", "step peak per rank (MiB)",
              "estimate beyond states (MiB)", "peak RSS per rank (MiB)"]  # fmt: skip
    cells = [
        [
            str(sp),
            f"{r['measured']['tokens_per_s']:.0f}",
            f"{r['measured']['peak_bytes'] / MIB:.0f}",
            f"{r['measured']['step_peak_bytes'] / MIB:.0f}",
            f"{r['estimate']['beyond_states'] / MIB:.0f}",
            f"{r['measured']['max_rss_bytes'] / MIB:.0f}",
        ]
        for sp, r in rows.items()
    ]
    lines = [markdown_table(header, cells)]
    one, two = rows[1], rows[2]
    saved = one["measured"]["step_peak_bytes"] - two["measured"]["step_peak_bytes"]
    predicted = one["estimate"]["allocated"] - two["estimate"]["allocated"]
    parts = one["estimate"]["components"], two["estimate"]["components"]
    fewer = (parts[0]["activations"] - parts[1]["activations"]) / MIB
    more = parts[1].get("sp_all_to_all", 0) / MIB
    lines.append("")
    lines.append(
        f"memory saved per rank by sp 2: measured {saved / MIB:.0f} MiB (step peak), estimated {predicted / MIB:.0f} "
        f"MiB (activations {fewer:.0f} MiB less, all-to-all {more:.0f} MiB more)"
    )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--seqs", type=int, default=2, help="sequences per step (the global batch)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--out", default="benchmarks/results/speed/sp-memory.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_model(model, args)
        for sp in (1, 2):
            ranks = run_sp(model, sp, args, Path(tmp))
            busiest = max(ranks, key=lambda r: r["peak_bytes"])
            rows[sp] = {"measured": {**busiest, "tokens_per_s": ranks[0]["tokens_per_s"]}, "ranks": ranks}
            rows[sp]["estimate"] = estimate(model, sp, args)
    text = table(rows)
    print(text)
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows, "table": text}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
