"""A stand-in for a recipe, run by the real launcher under torchrun (``RLCTL_TEST_RECIPE``): rank 1
fails first, rank 0 dies a moment later of the broken connection, as a real job's peers do.

``FAIL_MODE``: ``user`` (rank 1: a UserError), ``internal`` (rank 1: a bug), ``hang`` (both ranks wait
until interrupted: Ctrl-C during start-up).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

from rlctl.runtime.errors import write_rank_error

USER_MESSAGE = "data.answer_field 'solution' is missing in row 3; pass --set data.answer_field=FIELD"
INTERNAL_MESSAGE = "ZeroDivisionError: division by zero"
PEER_MESSAGE = "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:29500"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    run_dir = parser.parse_args().run_dir
    rank, mode = int(os.environ["RANK"]), os.environ.get("FAIL_MODE", "user")
    if mode == "hang":
        (Path(run_dir) / f"started_rank_{rank}").touch()  # the test waits for these before its Ctrl-C
        try:
            time.sleep(120)
        except KeyboardInterrupt:
            write_rank_error(run_dir, rank, "interrupted", "KeyboardInterrupt")
            return 130
        return 0
    if rank == 1:
        if mode == "user":
            write_rank_error(run_dir, 1, "user", USER_MESSAGE)
        else:
            try:
                1 / 0  # noqa: B018
            except ZeroDivisionError as e:
                write_rank_error(run_dir, 1, "internal", f"{type(e).__name__}: {e}", traceback.format_exc())
        print("Traceback (most recent call last):\n  rank 1 failed", file=sys.stderr)
        return 1
    time.sleep(1.0)  # the peer notices later
    write_rank_error(run_dir, 0, "internal", PEER_MESSAGE, "Traceback ...\nRuntimeError: gloo")
    return 1


if __name__ == "__main__":
    sys.exit(main())
