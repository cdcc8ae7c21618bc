"""Under torchrun (gloo): every rank calls map_rows on the same rows; each writes how often its row
function ran and what it got into OUT/rank_N.json."""

import json
import sys

import torch.distributed as dist

from rlctl.data.mapped import map_rows

dist.init_process_group("gloo")
out = sys.argv[1]
calls = []


def fn(row):
    calls.append(row["x"])
    return {"ids": [row["x"], row["x"] * 2], "bad": "" if row["x"] % 3 else "multiple of 3"}


rows = [{"x": i} for i in range(50)]
got = map_rows(rows, fn, cache_dir=f"{out}/cache", key="k1", desc="t", features={"ids": "int32 list", "bad": "string"})
with open(f"{out}/rank_{dist.get_rank()}.json", "w") as f:
    json.dump({"calls": len(calls), "got": got}, f)
dist.destroy_process_group()
