"""Tokenization through ``datasets.map``: batched, cached in the run directory, done once.

:func:`map_rows` runs a row function over every row of a data source with ``datasets.map`` (batched,
a progress bar on rank 0) and keeps the result as an Arrow cache file named by a hash of everything the
result depends on (the source file's path, size and time, the data settings, the tokenizer). Rank 0
maps first while the other ranks wait at a barrier, then they load the cache file: the tokenization
runs once per run (and not at all when the run is resumed with the same data). Without a cache
directory (tests, tools) the rows are mapped in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

CACHE_VERSION = 1  # bump when what a row function writes changes


def source_stamp(path: str) -> dict:
    """What identifies the contents of a data source cheaply: path, size and modification time (of every
    file of a directory); a hub name stands for itself."""
    p = Path(path).expanduser()
    if not p.exists():
        return {"hub": str(path)}
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    return {"path": str(p.resolve()), "files": [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]}


def tokenizer_stamp(tokenizer) -> dict:
    template = tokenizer.chat_template or ""
    return {
        "name": getattr(tokenizer, "name_or_path", ""),
        "vocab": len(tokenizer),
        "template": hashlib.sha256(str(template).encode()).hexdigest()[:16],
        "eos": tokenizer.eos_token_id,
    }


def cache_key(**parts) -> str:
    text = json.dumps({"v": CACHE_VERSION, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def map_rows(
    rows: list[dict],
    fn: Callable[[dict], dict],
    *,
    cache_dir: str | Path | None,
    key: str,
    desc: str,
    features: dict[str, str],
    log: Callable[[str], None] = lambda msg: None,
) -> list[dict]:
    """``[fn(row) for row in rows]`` through ``datasets.map`` (batched), cached as
    ``cache_dir/<desc>-<key>.arrow``. ``fn`` returns a dict of plain columns; ``features`` names their
    types: "int32 list", "float32 list" or "string". A "float32 list" column (image pixels) comes back as
    numpy arrays: as Python floats it would take 8 times the memory, and minutes to build."""
    import datasets

    types = {
        "int32 list": datasets.Sequence(datasets.Value("int32")),
        "float32 list": datasets.Sequence(datasets.Value("float32")),
        "string": datasets.Value("string"),
    }
    schema = datasets.Features({k: types[v] for k, v in features.items()})

    def batch_fn(batch: dict) -> dict:
        outs = [fn(rows[i]) for i in batch["i"]]
        return {k: [o[k] for o in outs] for k in outs[0]} if outs else {}

    if cache_dir is None or not rows:
        return [fn(r) for r in rows]
    index = datasets.Dataset.from_dict({"i": list(range(len(rows)))})
    cache_dir = Path(cache_dir)
    cache_file = cache_dir / f"{desc}-{key}.arrow"
    how = dict(batched=True, batch_size=256, remove_columns=["i"], features=schema, cache_file_name=str(cache_file))
    how.update(new_fingerprint=key, load_from_cache_file=True)  # every rank: the same call, the same file
    d = _dist()
    main = d is None or d.get_rank() == 0
    began = time.perf_counter()
    cached = cache_file.is_file()
    if main:
        cache_dir.mkdir(parents=True, exist_ok=True)
        if not cached and os.environ.get("RLCTL_DATA_PROGRESS", "1") == "1":
            datasets.enable_progress_bars()
        try:
            mapped = index.map(batch_fn, **how, desc=f"tokenizing {desc}")
        finally:
            datasets.disable_progress_bars()
    if d is not None:
        d.barrier()  # rank 0 has written the cache file
    if not main:  # the same call finds rank 0's file (or maps by itself where the run dir is not shared)
        mapped = index.map(batch_fn, **how)
    floats = [k for k, v in features.items() if v == "float32 list"]  # pixels: numpy, never Python floats
    out = list(mapped.with_format("numpy", columns=floats, output_all_columns=True)) if floats else mapped.to_list()
    if main:
        done = "loaded from the cache" if cached else "tokenized"
        log(f"{desc}: {len(out)} rows {done} in {time.perf_counter() - began:.1f}s ({cache_file})")
    return out
