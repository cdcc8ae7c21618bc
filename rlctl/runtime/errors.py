"""A failing rank's report: ``RUN/errors/rank_N.json`` (:meth:`rlctl.runtime.layout.RunPaths.rank_error`).

The launcher reads these after torchrun exits and shows the earliest one that is not an interruption,
as one line (kind ``user``: ``error: ...``, exit 2; ``internal``: the rank and the log, exit 1).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rlctl.runtime.layout import RunPaths

KINDS = ("user", "internal", "interrupted")


def write_rank_error(run_dir: str | Path, rank: int, kind: str, message: str, traceback: str = "") -> Path:
    """Write one rank's failure atomically (a reader never sees half a file); ``message`` becomes one line."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = RunPaths(Path(run_dir)).rank_error(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "kind": kind, "message": " ".join(str(message).split()), "traceback": traceback}
    record["time"] = time.time()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return path
