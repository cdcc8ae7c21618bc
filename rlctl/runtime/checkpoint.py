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

import json
import os
import shutil
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from rlctl.errors import UserError
from rlctl.runtime.layout import (
    LATEST,
    RNG_DIR,
    STEP_PREFIX,
    STEP_RE,
    TMP_PREFIX,
    TRAINER_STATE,
    checkpoint_problem,
    file_sizes,
    is_complete,
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
)


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
    ("" for the main model, "critic" for PPO's critic). Returns the final directory."""
    root = Path(root)
    rank = dist.get_rank()
    final = root / step_name(step)
    tmp = root / tmp_name(step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root)
        tmp.mkdir()
    dist.barrier()
    for sub, engine in engines.items():
        engine.save_checkpoint(tmp / sub if sub else tmp)
    save_rng(tmp / RNG_DIR, rank, rng_state)
    if rank == 0 and os.environ.get(KILL_DURING_SAVE_ENV, "") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    fault_point("write", step)
    dist.barrier()
    if rank == 0:
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
        (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
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
