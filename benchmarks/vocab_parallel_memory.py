"""Host memory of one forward + backward of Megatron's vocab-parallel losses (rlctl.algos.vocab_parallel) on CPU:
the row-chunked functions against the same functions in one chunk (``CHUNK_ELEMENTS`` raised to the whole
tensor: every float32 temporary at full size, as before the chunking).

    python benchmarks/vocab_parallel_memory.py [--rows 8192] [--vocab 16384]

Each case runs in a fresh process (one gloo rank, the whole vocabulary) and reports the growth of its peak
resident memory over the bf16 logits, less the bf16 gradient the backward returns. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CASES = ("logp", "kl", "jsd0", "jsd0.5")


def measure(case: str, chunked: bool, rows: int, vocab: int, port: int) -> float:
    """One case in this process: MiB of peak RSS growth beyond the bf16 gradient."""
    import resource

    import torch
    import torch.distributed as dist

    from rlctl.algos import vocab_parallel as vp

    if not chunked:
        vp.CHUNK_ELEMENTS = rows * vocab
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    g, group = torch.Generator().manual_seed(0), dist.group.WORLD

    def logits():  # filled in slices: no float32 temporary of the whole tensor raises the base peak
        out = torch.empty(rows, vocab, dtype=torch.bfloat16)
        for i in range(0, rows, 256):
            out[i : i + 256] = torch.randn(min(256, rows - i), vocab, generator=g) * 3
        return out

    s, t = logits().requires_grad_(True), logits()
    labels, w = torch.randint(0, vocab, (rows,), generator=g), torch.randn(rows)

    def loss(n: int):
        if case == "logp":
            lp, ent = vp.vocab_parallel_logprobs(s[:n], labels[:n], 0, 0.7, group)
            return (w[:n] * lp).sum() + (w[:n] * ent).sum()
        beta = 1.0 if case == "kl" else float(case[3:])
        return (w[:n] * vp.vocab_parallel_jsd(s[:n], t[:n], 0.7, beta, group)).sum()

    loss(64).backward()  # warm the allocator and the kernels
    s.grad = None
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    loss(rows).backward()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return (grown - s.grad.numel() * s.grad.element_size()) / 2**20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)  # CASE CHUNKED PORT: a child process
    a = p.parse_args()
    if a.one:
        case, chunked, port = a.one
        print(json.dumps(measure(case, chunked == "1", a.rows, a.vocab, int(port))))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = {"rows": a.rows, "vocab": a.vocab, "MiB": {}}
    for i, case in enumerate(CASES):
        got = {}
        for chunked in (False, True):
            argv = [sys.executable, __file__, "--rows", str(a.rows), "--vocab", str(a.vocab)]
            argv += ["--one", case, str(int(chunked)), str(29500 + 2 * i + chunked)]
            res = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
            got["chunked" if chunked else "one_chunk"] = json.loads(res.stdout.strip().splitlines()[-1])
        out["MiB"][case] = got
        print(f"{case}: one chunk {got['one_chunk']:.0f} MiB, chunked {got['chunked']:.0f} MiB", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
