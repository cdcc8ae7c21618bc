"""A recipe's entry point on each rank: run context, polite stops, and how a failure is reported.

A recipe runs as ``python -m rlctl.recipes.<method> --run-dir RUN`` under torchrun. :func:`recipe_main`
reads RUN/config.yaml (the resolved config: every decision of the plan is in it; plan.json is only
the record), starts torch.distributed, seeds, turns SIGINT/SIGTERM into a polite stop request, and
reports a failure in ``RUN/errors/rank_N.json`` (:meth:`RunPaths.rank_error`)::

    {"rank": 0, "kind": "user" | "internal" | "interrupted", "message": "one line",
     "traceback": "..." | null, "time": 1764000000.0}

A :class:`UserError` is ``user`` (exit 2; the launcher shows the earliest rank's line), any other
exception ``internal`` with its traceback (exit 1), a KeyboardInterrupt ``interrupted`` (exit 130, and
rank 0 writes summary.json with status "interrupted" when the body had not written one).
"""

from __future__ import annotations

import argparse
import errno
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from rlctl.config import RunConfig, load_config
from rlctl.errors import UserError, os_error_line
from rlctl.runtime.dist import Dist, destroy_all, init_distributed
from rlctl.runtime.errors import INTERRUPTED, write_rank_error
from rlctl.runtime.layout import RunPaths, interrupted_summary, write_json_atomic
from rlctl.runtime.rng import seed_everything
from rlctl.runtime.shared_dir import check_shared_run_dir
from rlctl.runtime.signals import note_stop, requested_early

# Test hooks (environment variables), documented in docs/sft.md:
STOP_AFTER_ENV = "RLCTL_STOP_AFTER_STEP"  # behave as if Ctrl-C arrived right after this step


class StopRequest:
    """SIGINT/SIGTERM set a flag; the training loop checks :meth:`local` once per step (collectively).

    A second signal interrupts at once (the default behaviour).
    """

    def __init__(self) -> None:
        self.requested = requested_early()  # a Ctrl-C while the recipe was still importing
        stop_after = os.environ.get(STOP_AFTER_ENV, "")
        self.stop_after = int(stop_after) if stop_after.strip() else None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        self.requested = True
        note_stop()  # long work (reward calls) reads it: rlctl.runtime.signals.stop_requested

    def local(self, step: int) -> bool:
        """Whether this rank wants to stop after ``step`` (count of finished steps; 0 = before the first)."""
        return self.requested or (self.stop_after is not None and 0 < step and step >= self.stop_after)


@dataclass
class RunContext:
    cfg: RunConfig
    paths: RunPaths
    dist: Dist
    stop: StopRequest

    def log(self, msg: str) -> None:
        """A line in train.log from rank 0 (stdout of the ranks goes there)."""
        if self.dist.is_main:
            print(msg, flush=True)


def _quiet_libraries() -> None:
    """No per-rank progress bars from transformers/datasets in train.log."""
    import datasets
    import transformers

    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


def _interrupted_summary(paths: RunPaths) -> None:
    """summary.json of a run interrupted before the loop could write one: its last checkpoint, if any."""
    write_json_atomic(paths.summary, interrupted_summary(paths))


DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def _internal(paths: RunPaths, rank: int, e: BaseException, message: str = "") -> int:
    """A failure that is a bug: its traceback in train.log and the rank's error file; exit status 1."""
    tb = traceback.format_exc()
    write_rank_error(paths.root, rank, "internal", message or f"{type(e).__name__}: {e}", tb)
    print(tb, file=sys.stderr, flush=True)
    return 1


def _first_failure(e: CheckpointException) -> str:
    """The first rank's exception inside torch.distributed.checkpoint's report (its str is every traceback)."""
    for r, failure in sorted(e.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        return f"checkpoint load/save failed on rank {r}: {type(exc).__name__}: {exc}"
    return "checkpoint load/save failed (CheckpointException)"


def recipe_main(body: Callable[[RunContext], None], argv: list[str] | None = None) -> None:
    """Parse ``--run-dir``, set everything up, run ``body`` and exit with 0, 2 (user error), 130
    (interrupted) or 1."""
    stop = StopRequest()  # first: a Ctrl-C during start-up is a stop request too
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    paths = RunPaths(Path(args.run_dir))
    rank = int(os.environ.get("RANK", "0"))
    code = 0
    try:
        cfg = load_config(paths.config)
        timeout = timedelta(minutes=cfg.hardware.collective_timeout_min)
        d = init_distributed(cfg.hardware.device, cfg.rollout.procs, timeout)
        check_shared_run_dir(paths, d.device)  # before anything loads: one run directory for every node
        _quiet_libraries()
        seed_everything(cfg.train.seed)
        body(RunContext(cfg, paths, d, stop))
    except UserError as e:
        write_rank_error(paths.root, rank, "user", str(e))
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except OSError as e:
        if e.errno not in DISK_ERRORS:
            code = _internal(paths, rank, e)
        else:  # a full or read-only disk, no permission: the user's to fix, one line
            write_rank_error(paths.root, rank, "user", os_error_line(e))
            print(f"error: {os_error_line(e)}", file=sys.stderr, flush=True)
            code = 2
    except KeyboardInterrupt:
        write_rank_error(paths.root, rank, "interrupted", "interrupted (a second Ctrl-C or a signal)")
        if rank == 0 and not paths.summary.is_file():
            _interrupted_summary(paths)
        print(f"rank {rank}: interrupted", file=sys.stderr, flush=True)
        code = INTERRUPTED
    except Exception as e:  # noqa: BLE001 (any other failure: a traceback in train.log, exit 1)
        code = _internal(paths, rank, e)
    except CheckpointException as e:  # a BaseException: a checkpoint load or save failed on some rank
        code = _internal(paths, rank, e, _first_failure(e))
    finally:
        sys.stdout.flush()
        if code == 0:
            destroy_all()
        # os._exit skips the shutdown that would end the helper processes libraries started (megatron-core's
        # checkpoint writer keeps a multiprocessing Manager per rank): end them, or they outlive the run
        for child in multiprocessing.active_children():
            child.terminate()
    # os._exit: a rank that failed must not wait in interpreter shutdown on peers that hang
    os._exit(code)
