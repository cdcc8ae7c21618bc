"""Checkpoints: save, find and load, with the layout other tools read (see docs/sft.md).

::

    RUN/checkpoints/
      latest                       # text: the name of the last complete checkpoint, e.g. step_000200
      step_000200/
        .metadata, __*_*.distcp    # the engine's save_checkpoint: FSDP: torch.distributed.checkpoint of
                                   #   {"model", "optim", "scheduler"}; Megatron: megatron-core's
                                   #   dist_checkpointing (torch_dist, plus metadata.json and common.pt)
        critic/                    # PPO only: the critic's engine, same layout
        rng/rank_{r}.json, .safetensors  # each rank's RNG states (no pickle; see rlctl.runtime.rng)
        trainer_state.json         # {"step", "epoch", "world_size", "backend", "method", "lora", "data", ...}
        huggingface/               # config.json, generation_config.json, tokenizer files
        lora_adapter/adapter_config.json   # when LoRA was used

Every name comes from :mod:`rlctl.runtime.layout`. The engines write and read their own files
(:meth:`TrainEngine.save_checkpoint` / :meth:`~TrainEngine.load_checkpoint`); this module owns the
directory, the RNG states, the trainer state and the atomic rename. A checkpoint is written under
``.tmp-step_N`` and renamed only once every rank has finished, so a crash mid-write leaves the previous
checkpoint (and ``latest``) intact; a checkpoint that is replaced (the same step saved again after a
resume) or pruned (``keep_last``) is first renamed to ``.tmp-old-step_N`` and deleted after, so a
``step_N`` directory is always complete. ``.tmp-*`` leftovers of a crash are deleted by the next save.
Before loading, :func:`rlctl.runtime.layout.choose_resume` checks every file it names (see
docs/reliability.md). Both formats store each tensor with its global shape, so a
checkpoint loads on any number of processes (FSDP) or any tp/pp (Megatron); it loads with the backend
that saved it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from rlctl.errors import UserError, os_error_line
from rlctl.runtime.dist import all_gather_objects
from rlctl.runtime.layout import (
    CHECKSUMS,
    LATEST,
    RNG_DIR,
    STEP_PREFIX,
    STEP_RE,
    TMP_PREFIX,
    TRAINER_STATE,
    checkpoint_problem,
    file_digests,
    file_sizes,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    step_name,
    tmp_name,
    trash_name,
    write_text_atomic,
)
from rlctl.runtime.rng import load_rng, save_rng

if TYPE_CHECKING:
    from rlctl.engines.base import TrainEngine

# Test hooks (environment variables) for the fault-injection tests (tests/faults, docs/reliability.md):
KILL_DURING_SAVE_ENV = "RLCTL_KILL_DURING_SAVE"  # STEP: rank 0 dies mid-write of this step's checkpoint
FAULT_ENV = "RLCTL_FAULT"  # POINT:STEP[:RANK] (rank 0 by default): that rank SIGKILLs itself there
FAULT_POINTS = (
    "step",  # right after optimizer step STEP (runtime.fit)
    "write",  # a save: after this rank's DCP shards and RNG files, before the other ranks finished
    "rename",  # a save: the .tmp- directory is complete, not yet renamed
    "latest",  # a save: step_N renamed, ``latest`` not yet updated
    "prune",  # a save: an old checkpoint renamed to .tmp-old-, not yet deleted
)  # and "enospc" (:func:`_disk_fault`): not a kill, a full disk while this rank writes


def fault_point(point: str, step: int) -> None:
    """Test hook: SIGKILL this process when ``RLCTL_FAULT`` names this point, step and rank."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    want, _, rest = spec.partition(":")
    at, _, rank = rest.partition(":")
    if want == point and at == str(step) and (int(rank) if rank else 0) == dist.get_rank():
        os.kill(os.getpid(), signal.SIGKILL)


def read_trainer_state(path: str | Path) -> dict:
    return json.loads((Path(path) / TRAINER_STATE).read_text())


def save_checkpoint(
    root: str | Path,
    step: int,
    engines: dict[str, TrainEngine],
    *,
    trainer_state: dict,
    meta_dir: str | Path | None,
    rng_state: dict,
    keep_last: int,
) -> Path:
    """Write a checkpoint (collective: every rank calls it). ``engines`` maps sub-directory -> engine
    ("" for the main model, "critic" for PPO's critic). Returns the final directory.

    A file-system error (a full disk, a read-only one) ends in one line (:func:`_disk_errors`): the
    ``.tmp-`` directory is removed and the previous checkpoint stays as it was."""
    root = Path(root)
    rank = dist.get_rank()
    final = root / step_name(step)
    tmp = root / tmp_name(step)
    if rank == 0:
        with _disk_errors(root, tmp, step):
            root.mkdir(parents=True, exist_ok=True)
            remove_leftovers(root)
            tmp.mkdir()
    dist.barrier()
    with _disk_errors(root, tmp, step):
        for sub, engine in engines.items():
            engine.save_checkpoint(tmp / sub if sub else tmp)
        save_rng(tmp / RNG_DIR, rank, rng_state)
        _disk_fault(tmp, step)
    if rank == 0 and os.environ.get(KILL_DURING_SAVE_ENV, "") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    fault_point("write", step)
    dist.barrier()
    digests = _digests_of_every_rank(tmp)  # collective: each rank hashes a share of the files
    if rank == 0:
        with _disk_errors(root, tmp, step):
            _finish(tmp, step, engines, trainer_state=trainer_state, meta_dir=meta_dir, digests=digests)
        fault_point("rename", step)
        if final.exists():  # the same step saved again (after a resume): out of sight first
            _remove(final)
        os.replace(tmp, final)
        fault_point("latest", step)
        write_text_atomic(root / LATEST, final.name + "\n")
        for old in list_checkpoints(root)[:-keep_last]:
            _remove(old, step)
    dist.barrier()
    return final


def _finish(tmp: Path, step: int, engines: dict[str, TrainEngine], *, trainer_state, meta_dir, digests) -> None:
    """Rank 0, once every rank has written: huggingface/, the LoRA configs, and last trainer_state.json
    with the manifest (every other file's size and sha256)."""
    backend = next(iter(engines.values())).backend  # every engine of a run has the same backend
    state = {
        **trainer_state,
        "step": step,
        "world_size": dist.get_world_size(),
        "backend": backend,
        "lora": engines[""].lora_info() if "" in engines else None,
    }
    if "critic" in engines:
        state["critic_lora"] = engines["critic"].lora_info()
    if meta_dir is not None:
        shutil.copytree(meta_dir, tmp / "huggingface", dirs_exist_ok=True)
    for sub, engine in engines.items():
        if engine.lora_info():
            out = tmp / sub / "lora_adapter" if sub else tmp / "lora_adapter"
            out.mkdir(parents=True, exist_ok=True)
            engine.save_lora_config(out)
    state["files"] = file_sizes(tmp)  # every file but this one, with its size (layout.checkpoint_problem)
    rest = [name for name in state["files"] if name not in digests]  # written by rank 0 just now
    state[CHECKSUMS] = dict(sorted({**digests, **file_digests(tmp, rest)}.items()))  # layout.checksum_problem
    (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")


def _digests_of_every_rank(tmp: Path) -> dict[str, str]:
    """The sha256 of every file in ``tmp`` now: rank r hashes files r, r + W, ... (in name order)."""
    names = sorted(file_sizes(tmp))
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = file_digests(tmp, names[rank::world])
    merged: dict[str, str] = {}
    for part in all_gather_objects(mine):
        merged.update({k: v for k, v in part.items() if v is not None})
    return merged


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextmanager
def _disk_errors(root: Path, tmp: Path, step: int):
    """An OSError while saving (also inside torch.distributed.checkpoint's CheckpointException): the
    ``.tmp-`` directory removed, then one UserError naming the path, the space and the checkpoint kept."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (OSError, CheckpointException) as e:
        err = _os_error_in(e)
        if err is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(_disk_message(root, step, err)) from None


def _os_error_in(exc: BaseException | None, depth: int = 0) -> OSError | None:
    """The OSError behind ``exc``: itself, its cause or context, or a rank's failure in a CheckpointException."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, OSError):
        return exc
    for failure in getattr(exc, "failures", {}).values():  # {rank: (exception, traceback)}
        if found := _os_error_in(failure[0] if isinstance(failure, tuple) else failure, depth + 1):
            return found
    return _os_error_in(exc.__cause__ or exc.__context__, depth + 1)


def _disk_message(root: Path, step: int, err: OSError) -> str:
    previous = latest_checkpoint(root)
    parts = [f"saving checkpoint {step_name(step)} in {root} failed: {os_error_line(err)}"]
    if err.errno in DISK_FULL:
        try:
            free = _size(shutil.disk_usage(root).free) + " free there"
        except OSError:
            free = "the free space unknown"
        need = sum(file_sizes(previous).values()) + read_size(previous) if previous else 0
        parts.append(f"{free}, a checkpoint of this run takes about {_size(need)}" if need else free)
    if previous is not None:
        parts.append(f"the previous checkpoint {previous.name} is intact: --resume auto continues from it")
    else:
        parts.append("no earlier checkpoint of this run")
    return "; ".join(parts)


def read_size(checkpoint: Path) -> int:
    """The size of a checkpoint's trainer_state.json (the one file its manifest leaves out)."""
    try:
        return (checkpoint / TRAINER_STATE).stat().st_size
    except OSError:
        return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _disk_fault(tmp: Path, step: int) -> None:
    """Test hook: ``RLCTL_FAULT=enospc:STEP[:RANK]``: this rank's write of the step's checkpoint finds
    the disk full (after its shard files are written, as a real full disk would, part-way)."""
    want, _, rest = os.environ.get(FAULT_ENV, "").partition(":")
    at, _, rank = rest.partition(":")
    if want == "enospc" and at == str(step) and (int(rank) if rank else 0) == dist.get_rank():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / f"__{dist.get_rank()}_0.distcp"))


def remove_leftovers(root: str | Path) -> None:
    """Delete the ``.tmp-*`` directories of saves or deletions a crash interrupted (rank 0, when no
    save is under way: at the start of a save, and when a run resumes).

    One leftover is kept: a step saved again (after a resume) moves its old copy out of sight before
    the new one is renamed in; a crash between the two renames leaves the complete new copy under
    ``.tmp-step_N`` and no ``step_N``. That copy, when it passes :func:`checkpoint_problem`, becomes
    ``step_N`` (the name ``latest`` already holds) instead of being deleted."""
    root = Path(root)
    for leftover in sorted(root.glob(f"{TMP_PREFIX}{STEP_PREFIX}*")):
        final = root / leftover.name[len(TMP_PREFIX) :]
        if leftover.is_dir() and not final.exists() and STEP_RE.match(final.name):
            if (leftover / TRAINER_STATE).is_file() and checkpoint_problem(leftover) is None:
                os.replace(leftover, final)
    for leftover in root.glob(f"{TMP_PREFIX}*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)


def _remove(checkpoint: Path, step: int | None = None) -> None:
    """Delete a checkpoint so that no half-deleted ``step_N`` is ever visible: rename, then delete."""
    trash = checkpoint.with_name(trash_name(checkpoint.name))
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(checkpoint, trash)
    if step is not None:
        fault_point("prune", step)
    shutil.rmtree(trash, ignore_errors=True)


def load_checkpoint(
    path: str | Path, engines: dict[str, TrainEngine], *, trust: bool = False
) -> tuple[dict, dict | None]:
    """Load model/optimizer/scheduler into ``engines`` (resharding to this world size).

    Returns (trainer_state, this rank's RNG states or None when the checkpoint has none for it).
    ``trust`` is handed to the reader of older pickled RNG files.
    """
    path = Path(path)
    if not is_complete(path):  # the caller checked every file (layout.choose_resume -> checkpoint_problem)
        raise UserError(f"{path} is not a complete rlctl checkpoint (no {TRAINER_STATE} or .metadata)")
    trainer_state = read_trainer_state(path)
    saved_by = trainer_state.get("backend", "fsdp")
    for sub, engine in engines.items():
        if engine.backend != saved_by:
            raise UserError(
                f"{path} was saved by the {saved_by} engine; resume it with --set parallel.backend="
                f"{saved_by} (or convert it: rlctl convert)"
            )
        where = path / sub if sub else path
        if not (where / ".metadata").is_file():
            raise UserError(f"{path} has no '{sub}' model; it was saved by another method")
        engine.load_checkpoint(where)
    return trainer_state, load_rng(path / RNG_DIR, dist.get_rank(), trust=trust)
