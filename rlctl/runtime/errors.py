"""A failing rank's report: ``RUN/errors/rank_N.json`` (:meth:`rlctl.runtime.layout.RunPaths.rank_error`).

The launcher reads these after torchrun exits and shows the earliest one that is not an interruption,
as one line (kind ``user``: ``error: ...``, exit 2; ``internal``: the rank and the log, exit 1).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rlctl.errors import one_line
from rlctl.runtime.layout import RunPaths

INTERRUPTED = 130  # exit status of a run a Ctrl-C stopped cleanly (the ranks' and the launcher's)

KINDS = ("user", "internal", "interrupted")


def write_rank_error(run_dir: str | Path, rank: int, kind: str, message: str, traceback: str | None = None) -> Path:
    """Write one rank's failure atomically (a reader never sees half a file); ``message`` becomes one line.

    Never raises for a file-system problem (it runs while the rank is failing): that is printed instead."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = RunPaths(Path(run_dir)).rank_error(rank)
    record = {"rank": rank, "kind": kind, "message": one_line(message), "traceback": traceback, "time": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        print(f"rank {rank}: could not write {path}: {e}", file=sys.stderr, flush=True)
    return path
