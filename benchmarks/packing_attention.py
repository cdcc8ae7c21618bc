"""CPU seconds of one forward + backward over the same documents, by how they are laid out for attention.

    python benchmarks/packing_attention.py [--hidden 512] [--layers 8] [--max-len 1024] [--docs 8] [--repeats 3]

The documents have SFT-like lengths (log-uniform from 57 to max-len tokens). Layouts:

* ``packed-mask``: one packed row, positions restarting, transformers' block-diagonal sdpa mask (the
  former rlctl default: every pair of positions of the row is computed);
* ``packed-varlen``: the same row, attention split per document (rlctl.engines.varlen, the default now);
* ``bins-max-len``: rows of at most max-len tokens (first-fit-decreasing), one forward each, block mask;
* ``padded``: one row per document, right-padded to the longest, 2-D mask (TRL's default layout);
* ``one-by-one``: each document alone (the floor: no mask, no padding, one call per document).

One process, one thread; the median of ``--repeats`` runs. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from pathlib import Path

import torch


def lengths(n: int, max_len: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [int(2 ** rng.uniform(math.log2(57), math.log2(max_len))) for _ in range(n)]


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        runs.append(time.process_time() - t)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/speed/packing-attention.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlctl.data.packing import pack_bins
    from rlctl.engines import varlen

    cfg = Qwen2Config(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.max_len,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    lens = lengths(args.docs, args.max_len)
    docs = [torch.randint(4, cfg.vocab_size, (n,)) for n in lens]

    def run(ids, pos, mask=None, **kw):
        out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False, **kw).logits
        out.float().mean().backward()
        model.zero_grad(set_to_none=True)

    row = torch.cat(docs)[None]
    row_pos = torch.cat([torch.arange(n) for n in lens])[None]

    def packed_mask():
        cfg._attn_implementation_internal = "sdpa"
        run(row, row_pos)

    def packed_varlen():
        varlen.install(model.config)
        blocks = varlen.blocks_from_positions(row_pos)
        run(row, row_pos, varlen.placeholder_mask(row.device), rlctl_blocks=blocks)
        model.config._attn_implementation_internal = "sdpa"

    def bins():
        for b in pack_bins(lens, args.max_len):
            ids = torch.cat([docs[i] for i in b])[None]
            pos = torch.cat([torch.arange(lens[i]) for i in b])[None]
            run(ids, pos)

    def padded():
        width = max(lens)
        ids = torch.zeros(len(docs), width, dtype=torch.int64)
        mask = torch.zeros(len(docs), width, dtype=torch.int64)
        for r, d in enumerate(docs):
            ids[r, : len(d)], mask[r, : len(d)] = d, 1
        run(ids, torch.arange(width).expand(len(docs), width), mask)

    def one_by_one():
        for d in docs:
            run(d[None], torch.arange(len(d))[None])

    layouts = {
        "packed-mask": packed_mask,
        "packed-varlen": packed_varlen,
        "bins-max-len": bins,
        "padded": padded,
        "one-by-one": one_by_one,
    }
    results = {name: timed(fn, args.repeats) for name, fn in layouts.items()}
    tokens = sum(lens)
    load = os.getloadavg()[0]
    print(f"{len(lens)} documents, {tokens} tokens (lengths {min(lens)}..{max(lens)}); load average {load:.1f}")
    print(f"{'layout':15s} {'CPU s':>7s} {'tokens/CPU-s':>13s}")
    for name, s in results.items():
        print(f"{name:15s} {s:7.2f} {tokens / s:13,.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "lengths": lens, "load_avg": load, "cpu_s": results}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
