"""What every recipe (sft, grpo, ppo) shares on the rank side.

A recipe runs as ``python -m rlctl.recipes.<method> --run-dir RUN`` under torchrun. :func:`recipe_main`
wraps its body: it reads RUN/config.yaml and RUN/plan.json, starts torch.distributed, seeds, turns
SIGINT/SIGTERM into a polite stop request, and turns a :class:`UserError` into one line in
RUN/error.txt and exit code 2 (the launcher shows that line to the user, no traceback).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from rlctl.config import RunConfig, load_config
from rlctl.errors import UserError
from rlctl.launch import free_port

# Test hooks (environment variables), documented in docs/sft.md:
STOP_AFTER_ENV = "RLCTL_STOP_AFTER_STEP"  # behave as if Ctrl-C arrived right after this step


# ---------------------------------------------------------------------------------------------
# The run directory


@dataclass(frozen=True)
class RunPaths:
    """Every file a run writes, relative to its directory."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def error(self) -> Path:
        return self.root / "error.txt"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def train_log(self) -> Path:
        return self.root / "train.log"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def model_meta(self) -> Path:
        """config.json + tokenizer + generation_config of the trained model (copied into checkpoints)."""
        return self.root / "model_meta"


def load_plan(path: str | Path) -> SimpleNamespace:
    """plan.json as an object with attribute access (the fields of rlctl.plan.Plan)."""
    return SimpleNamespace(**json.loads(Path(path).read_text()))


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Distributed setup


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> Dist:
    """Start the default process group from torchrun's environment (gloo on CPU, nccl on CUDA).

    Without torchrun's variables it starts a one-process group, so a recipe or a test can run alone.
    """
    if device_type not in ("cpu", "cuda"):
        raise UserError(f"unknown device '{device_type}'; use cpu or cuda")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("the plan asks for CUDA but no GPU is visible; pass --device cpu or run on a GPU machine")
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            timeout=timedelta(minutes=30),
            device_id=device if device_type == "cuda" else None,
        )
    return Dist(rank, world, local, device)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float], device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """Sum a few floats over the ranks of ``group`` (default: all) in one collective (float64 for exact
    token counts). Sums over the data use the engine's ``dp_group``."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, group=group)
    return t.tolist()


def seed_everything(seed: int) -> None:
    """Same seed on every rank: data order is computed identically everywhere."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)


def rng_state() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---------------------------------------------------------------------------------------------
# Stopping politely


class StopRequest:
    """SIGINT/SIGTERM set a flag; the training loop checks :meth:`agreed` once per step (collectively).

    A second signal interrupts at once (the default behaviour).
    """

    def __init__(self) -> None:
        self.requested = False
        stop_after = os.environ.get(STOP_AFTER_ENV, "")
        self.stop_after = int(stop_after) if stop_after.strip() else None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            signal.signal(signum, signal.SIG_DFL)
            raise KeyboardInterrupt
        self.requested = True

    def local(self, step: int) -> bool:
        """Whether this rank wants to stop after ``step`` (1-based count of finished steps)."""
        return self.requested or (self.stop_after is not None and step >= self.stop_after)


# ---------------------------------------------------------------------------------------------
# Entry point


@dataclass
class RunContext:
    cfg: RunConfig
    plan: SimpleNamespace
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


def recipe_main(body: Callable[[RunContext], None], argv: list[str] | None = None) -> None:
    """Parse ``--run-dir``, set everything up, run ``body`` and exit with 0, 2 (user error) or 1."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    paths = RunPaths(Path(args.run_dir))
    rank = int(os.environ.get("RANK", "0"))
    code = 0
    try:
        stop = StopRequest()
        cfg = load_config(paths.config)
        plan = load_plan(paths.plan)
        d = init_distributed(getattr(plan, "device", "cpu"))
        _quiet_libraries()
        seed_everything(cfg.train.seed)
        body(RunContext(cfg, plan, paths, d, stop))
    except UserError as e:
        if rank == 0:
            paths.error.write_text(str(e) + "\n")
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except KeyboardInterrupt:
        print(f"rank {rank}: interrupted", file=sys.stderr, flush=True)
        code = 130
    except Exception:  # noqa: BLE001 (any other failure: a traceback in train.log, exit 1)
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        if dist.is_initialized() and code == 0:
            dist.destroy_process_group()
        # os._exit skips the shutdown that would end the helper processes libraries started (megatron-core's
        # checkpoint writer keeps a multiprocessing Manager per rank): end them, or they outlive the run
        for child in multiprocessing.active_children():
            child.terminate()
    # os._exit: a rank that failed must not wait in interpreter shutdown on peers that hang
    os._exit(code)
