"""Benchmark `rlctl convert fsdp-to-hf` on a verl-layout FSDP2 checkpoint built from random weights.

    python benchmarks/convert_bench.py [--gb 2] [--work DIR] [--verify]

Builds a Qwen2-shaped model of about ``--gb`` GB (fp32) as a 2-rank verl checkpoint (each rank
saves its DTensor shards, Shard(0) on an ("fsdp",) mesh, with torch.save), then measures it with
``rlctl bench convert`` (:func:`rlctl.bench.convert.bench_convert`: plain copies, import baseline,
fsdp-to-hf, and fsdp-to-hf --verify with ``--verify``, each in a fresh process). Compare the peak
RSS with ``largest tensor x world size``, what streaming should stay near.

Prints the table and a JSON line. The page cache is not dropped: the files were just written,
so copy and convert read equally warm data.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

WORLD = 2


def model_config(gb: float) -> dict:
    """A Qwen2-like config whose fp32 weights take about ``gb`` GB (layers scale to fit)."""
    hidden, inter, vocab, kv = 1024, 4096, 32000, 4
    per_layer = 2 * hidden * hidden + 2 * hidden * kv * 64 + 3 * hidden * inter + 2 * hidden + hidden + 2 * kv * 64
    embed = 2 * vocab * hidden
    layers = max(1, round((gb * 1e9 / 4 - embed) / per_layer))
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": kv,
        "head_dim": 64,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "dtype": "float32",
    }


def _build_rank(rank: int, actor: str, init_file: str) -> None:
    """One rank of the checkpoint: random local shards wrapped as DTensors, saved like verl does."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from transformers import AutoConfig, AutoModelForCausalLM

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("fsdp",))
    config = AutoConfig.from_pretrained(Path(actor) / "huggingface")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    gen = torch.Generator().manual_seed(rank)
    state = {}
    for name, shape in shapes.items():
        rows = -(-shape[0] // WORLD)
        local_rows = max(0, min(rows, shape[0] - rank * rows))
        local = torch.rand((local_rows, *shape[1:]), generator=gen)
        state[name] = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=shape, stride=torch.empty(shape, device="meta").stride()
        )
    torch.save(state, Path(actor) / f"model_world_size_{WORLD}_rank_{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def build_checkpoint(work: Path, gb: float) -> Path:
    import torch.multiprocessing as mp

    from rlctl.testing import build_tokenizer

    actor = work / "global_step_1" / "actor"
    meta = actor / "huggingface"
    meta.mkdir(parents=True)
    (meta / "config.json").write_text(json.dumps(model_config(gb), indent=2))
    build_tokenizer(meta)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": WORLD}))
    init_file = work / "pg_init"
    mp.spawn(_build_rank, args=(str(actor), str(init_file)), nprocs=WORLD, join=True)
    return actor


def main() -> None:
    from rlctl.bench.common import envelope
    from rlctl.bench.convert import bench_convert
    from rlctl.bench.tables import render

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0, help="checkpoint size in GB (fp32)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--verify", action="store_true", help="also time the conversion with verification")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="convert-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        actor = build_checkpoint(work, args.gb)
        result = {"build_s": time.perf_counter() - t0, **bench_convert(actor, verify=args.verify, work=work)}
        doc = envelope("convert", {"gb": args.gb, "verify": args.verify}, [result])
        render(doc)
        print(json.dumps(result))
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
