"""Checkpoints: save, find and load, with the layout other tools read (see docs/sft.md).

::

    RUN/checkpoints/
      latest                       # text: the name of the last complete checkpoint, e.g. step_000200
      step_000200/
        .metadata, __*_*.distcp    # the engine's save_checkpoint: FSDP: torch.distributed.checkpoint of
                                   #   {"model", "optim", "scheduler"}; Megatron: megatron-core's
                                   #   dist_checkpointing (torch_dist, plus metadata.json and common.pt)
        critic/                    # PPO only: the critic's engine, same layout
        rng/rank_{r}.pt            # each rank's RNG states
        trainer_state.json         # {"step", "epoch", "world_size", "backend", "method", "lora", "data", ...}
        huggingface/               # config.json, generation_config.json, tokenizer files
        lora_adapter/adapter_config.json   # when LoRA was used

The engines write and read their own files (:meth:`TrainEngine.save_checkpoint` /
:meth:`~TrainEngine.load_checkpoint`); this module owns the directory, the RNG states, the trainer
state and the atomic rename. A checkpoint is written under ``.tmp-step_N`` and renamed only once
every rank has finished, so a crash mid-write leaves the previous checkpoint (and ``latest``)
intact. Both formats store each tensor with its global shape, so a checkpoint loads on any number
of processes (FSDP) or any tp/pp (Megatron); it loads with the backend that saved it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from rlctl.engines.base import TrainEngine
from rlctl.errors import UserError

STEP_RE = re.compile(r"^step_(\d{6,})$")
KILL_DURING_SAVE_ENV = "RLCTL_KILL_DURING_SAVE"  # test hook: rank 0 dies mid-write of this step's checkpoint


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _is_complete(path: Path) -> bool:
    return (path / "trainer_state.json").is_file() and (path / ".metadata").is_file()


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root`` (RUN/checkpoints), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and _is_complete(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, else the newest complete one, else None."""
    root = Path(root)
    latest = root / "latest"
    if latest.is_file():
        candidate = root / latest.read_text().strip()
        if _is_complete(candidate):
            return candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """``checkpoint.resume``: "" -> None; "auto" -> the run's latest checkpoint or None; else a path.

    A path may name a checkpoint (step_N), a checkpoints directory or a run directory.
    """
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(Path(run_dir) / "checkpoints")
    p = Path(resume).expanduser()
    if _is_complete(p):
        return p
    for root in (p, p / "checkpoints"):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found is not None:
            return found
    raise UserError(
        f"--resume {resume}: no complete checkpoint there (expected a step_N directory with "
        f"trainer_state.json, or a run directory with checkpoints/)"
    )


def read_trainer_state(path: str | Path) -> dict:
    return json.loads((Path(path) / "trainer_state.json").read_text())


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    tmp = root / f".tmp-{final.name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over by a crash
        tmp.mkdir()
    dist.barrier()
    for sub, engine in engines.items():
        engine.save_checkpoint(tmp / sub if sub else tmp)
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save(rng_state, tmp / "rng" / f"rank_{rank}.pt")
    if rank == 0 and os.environ.get(KILL_DURING_SAVE_ENV, "") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    if rank == 0:
        backend = next(iter(engines.values())).backend  # every engine of a run has the plan's backend
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
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
        if final.exists():  # the same step saved again (after a resume)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_text_atomic(root / "latest", final.name + "\n")
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(path: str | Path, engines: dict[str, TrainEngine]) -> tuple[dict, dict | None]:
    """Load model/optimizer/scheduler into ``engines`` (resharding to this world size).

    Returns (trainer_state, this rank's RNG states or None when the checkpoint has none for it).
    """
    path = Path(path)
    if not _is_complete(path):
        raise UserError(f"{path} is not a complete rlctl checkpoint (no trainer_state.json or .metadata)")
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
    rng_file = path / "rng" / f"rank_{dist.get_rank()}.pt"
    rng = torch.load(rng_file, weights_only=False) if rng_file.is_file() else None
    return trainer_state, rng
