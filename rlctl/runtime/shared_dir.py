"""Is the run directory one directory for every node? Checked on the ranks before anything loads.

A multi-node run reads and writes one run directory from every node (config.yaml, checkpoints,
metrics.jsonl, the exported model): it must be on a filesystem all nodes share (NFS, Lustre, GPFS, ...)
at the same path. A directory per node (no shared filesystem, a node-local disk, a typo in ``-o``) would
otherwise fail much later, as a missing file on one node and a broken connection on the others.

:func:`check_shared_run_dir`: rank 0 writes a fresh random token into RUN/.shared_check
(:attr:`RunPaths.shared_token`), the token goes to every rank in one broadcast (which is also the
barrier after the write), every other rank reads the file and compares, and one all-reduce tells every
rank whether some rank did not see it. Then every rank raises the same one-line :class:`UserError`, so
each node's launcher prints it and exits 2.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rlctl.errors import UserError
from rlctl.runtime.layout import RunPaths, write_text_atomic

RETRY_S = 0.5  # a network filesystem may show another node's new file a little late (attribute caching)


def node_rank() -> int:
    """This node's rank: torchrun's GROUP_RANK (the rendezvous' order of the nodes)."""
    return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))


def _sees(path: Path, token: str, retry_s: float) -> bool:
    deadline = time.monotonic() + retry_s
    while True:
        try:
            if path.read_text().strip() == token:
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        if path.parent.is_dir():
            os.listdir(path.parent)  # refreshes the directory's entries on NFS
        time.sleep(0.1)


def check_shared_run_dir(paths: RunPaths, device: torch.device, *, retry_s: float = RETRY_S) -> None:
    """Raise one :class:`UserError` on every rank when some rank does not see rank 0's run directory.

    A no-op without a process group or with one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank = dist.get_rank()
    box = [None]
    if rank == 0:
        token = f"{secrets.token_hex(16)} {socket.gethostname()} {paths.root.absolute()}"
        write_text_atomic(paths.shared_token, token + "\n")
        box = [token]
    dist.broadcast_object_list(box, src=0)
    token = box[0]
    ok = rank == 0 or _sees(paths.shared_token, token, retry_s)
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    dist.all_reduce(flag)
    if int(flag.item()) == 0:
        return
    me = None if ok else f"node {node_rank()} ({socket.gethostname()})"
    blind = [m for m in _gather(me) if m]
    nodes = ", ".join(dict.fromkeys(blind))  # ranks of one node report that node once
    _, host, root = token.split(" ", 2)
    raise UserError(
        f"the run directory must be on a filesystem all nodes share: node 0 ({host}) wrote {root}, "
        f"{nodes} cannot see it; pass -o/--output-dir on a shared filesystem (NFS, Lustre, ...) "
        f"at the same path on every node"
    )


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
