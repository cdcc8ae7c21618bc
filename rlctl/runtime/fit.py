"""The one outer loop of every recipe (sft, grpo, ppo).

:func:`fit` runs a :class:`Trainer`'s steps with everything around them, the same for every method:

1. resume: ``checkpoint.resume`` ("" | auto | PATH) loads the engines, this rank's RNG state and the
   trainer's own state; a checkpoint of another method is refused; a data set of another size only
   warns (the order of the examples differs).
2. a stop vote before the first step: a Ctrl-C during start-up ends the run like one during training.
3. per step: ``trainer.train_step(step)`` -> one metrics record (logged every ``log.every`` steps and
   at the last); with validation data an evaluation every ``train.eval_every`` steps; a collective
   stop vote (SIGINT/SIGTERM on any rank, or the test hook); a checkpoint every
   ``checkpoint.save_every`` steps (-1, the default: :func:`rlctl.config.save_every_steps`).
4. at the end of a completed run: an evaluation (with validation data, unless the last step was just
   evaluated), the final checkpoint (unless just saved), the Hugging Face export
   (``checkpoint.export_hf``).
5. summary.json: status (completed | interrupted), step, total_steps, checkpoint, hf, on CUDA the busiest
   rank's memory before and after the final save (``cuda_memory``, :mod:`rlctl.runtime.cuda_memory`), and the
   trainer's own fields (data report...). An interrupted run saves a checkpoint at the step it
   reached (none when it stopped before the first step) and exports nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rlctl.config import save_every_steps
from rlctl.errors import UserError
from rlctl.formats.hf_writer import config_dtype
from rlctl.metrics import MetricsLogger
from rlctl.runtime.checkpoint import fault_point, load_checkpoint, remove_leftovers, save_checkpoint
from rlctl.runtime.cuda_memory import cuda_memory_now, cuda_memory_peaks, dump_snapshot, start_snapshot
from rlctl.runtime.dist import all_gather_objects, all_reduce_sum, barrier
from rlctl.runtime.layout import choose_resume, step_name, write_json_atomic
from rlctl.runtime.profile import StepProfiler
from rlctl.runtime.rng import rng_state, set_rng_state

if TYPE_CHECKING:
    from rlctl.engines.base import TrainEngine
    from rlctl.runtime.entry import RunContext


class Trainer(Protocol):
    """What :func:`fit` needs from a recipe's trainer."""

    total_steps: int
    steps_per_epoch: int
    num_examples: int  # training examples (sft: sequences, RL: prompts); a resume compares them
    has_eval: bool  # validation data exists

    def engines(self) -> dict[str, TrainEngine]:
        """The engines a checkpoint holds: "" (the model that is exported) and e.g. "critic"."""

    def train_step(self, step: int) -> dict:
        """One step (0-based ``step``); its metrics record, the same on every rank."""

    def evaluate(self, step: int) -> dict:
        """An eval record ``{"step", "kind": "eval", ...}`` after ``step`` finished steps."""

    def state(self) -> dict:
        """The trainer's own entries of trainer_state.json (besides step, epoch, data, method...)."""

    def load_state(self, state: dict) -> None:
        """Take back :meth:`state` from a checkpoint's trainer_state.json."""

    def summary(self) -> dict:
        """Extra fields of summary.json."""

    def close(self) -> None:
        """Release what the trainer holds (rollout engines...), before summary.json."""


def _data_state(ctx: RunContext, trainer: Trainer) -> dict:
    cfg = ctx.cfg
    return {
        "num_examples": trainer.num_examples,
        "batch_size": cfg.train.batch_size,
        "steps_per_epoch": trainer.steps_per_epoch,
        "seed": cfg.train.seed,
    }


def checkpoint(ctx: RunContext, trainer: Trainer, step: int) -> Path:
    """Save the run after ``step`` steps (collective)."""
    cfg = ctx.cfg
    state = {
        "method": cfg.method,
        "epoch": step // trainer.steps_per_epoch,
        "total_steps": trainer.total_steps,
        **trainer.state(),
        "data": _data_state(ctx, trainer),
    }
    return save_checkpoint(
        ctx.paths.checkpoints,
        step,
        trainer.engines(),
        trainer_state=state,
        meta_dir=ctx.paths.model_meta,
        rng_state=rng_state(),
        keep_last=cfg.checkpoint.keep_last,
    )


def resume(ctx: RunContext, trainer: Trainer) -> tuple[int, Path | None]:
    """Load ``checkpoint.resume`` when set: (the step to start from, the checkpoint)."""
    cfg = ctx.cfg
    # a damaged checkpoint: one named file. Rank 0 alone reads every byte (the checksums) and its
    # choice is every rank's (the launcher checked the same before launch).
    choice = choose_resume(cfg.checkpoint.resume, ctx.paths.root, checksums=ctx.dist.is_main)
    chosen = all_gather_objects(str(choice.path) if choice.path is not None else None)[0]
    path = Path(chosen) if chosen is not None else None
    if choice.note():
        ctx.log(choice.note())
    if ctx.dist.is_main and cfg.checkpoint.resume:
        remove_leftovers(ctx.paths.checkpoints)  # .tmp-* of the crashed run (no save is under way now)
    if path is None:
        if cfg.checkpoint.resume == "auto":
            ctx.log("resume=auto: no checkpoint found, starting from step 0")
        return 0, None
    state, rng = load_checkpoint(path, trainer.engines())
    if state.get("method", cfg.method) != cfg.method:
        raise UserError(f"{path} was saved by `rlctl {state.get('method')}`; resume it with that command")
    if rng is not None:
        set_rng_state(rng)
    trainer.load_state(state)
    data = state.get("data", {})
    saved_n = data.get("num_examples", data.get("num_train", data.get("num_prompts")))  # older checkpoints
    if saved_n != trainer.num_examples:
        ctx.log(
            f"warning: the data changed since {path.name} (training examples {saved_n} -> "
            f"{trainer.num_examples}); the data order differs"
        )
    ctx.log(
        f"resumed from {path} at step {state['step']} (saved by {state.get('world_size')} processes, "
        f"now {ctx.dist.world_size})"
    )
    return int(state["step"]), path


def _stop_agreed(ctx: RunContext, step: int, device) -> bool:
    """Collective: whether any rank wants to stop after ``step`` finished steps."""
    (votes,) = all_reduce_sum([float(ctx.stop.local(step))], device)
    return votes > 0


def fit(ctx: RunContext, trainer: Trainer) -> str:
    """Run ``trainer`` to the end (or to a stop request); returns "completed" or "interrupted"."""
    cfg, paths, d = ctx.cfg, ctx.paths, ctx.dist
    main = trainer.engines()[""]
    start, saved = resume(ctx, trainer)
    metrics = MetricsLogger(
        paths.metrics,
        backends=cfg.log.backends,
        enabled=d.is_main,
        project=cfg.log.project,
        run_name=cfg.log.run_name,
        config=cfg.to_dict(),
    )
    total, every = trainer.total_steps, cfg.train.eval_every
    save_every = save_every_steps(cfg.checkpoint.save_every, total)
    step = start
    interrupted = start < total and _stop_agreed(ctx, 0, main.device)  # Ctrl-C during start-up
    if interrupted:
        ctx.log(f"stopped before step {start + 1}" + (f"; checkpoint {saved}" if saved else ""))
    if start == 0 and cfg.train.eval_before and trainer.has_eval and not interrupted:
        metrics.log(trainer.evaluate(0))  # the baseline: the model before any update
    profiler = StepProfiler(paths.root, d.rank, ctx.log)  # RLCTL_PROFILE=START:END (rlctl.runtime.profile)
    snapshot = start_snapshot(main.device, d.rank)  # RLCTL_CUDA_MEMORY_SNAPSHOT=FILE (rlctl.runtime.cuda_memory)
    while step < total and not interrupted:
        profiler.begin(step + 1)
        record = trainer.train_step(step)
        record.update(cuda_memory_peaks(main.device))
        step += 1
        profiler.end(step)
        fault_point("step", step)  # test hook (RLCTL_FAULT=step:K)
        if step % cfg.log.every == 0 or step == total:
            metrics.log(record)
        if trainer.has_eval and every and step % every == 0:
            metrics.log(trainer.evaluate(step))
        if _stop_agreed(ctx, step, main.device) and step < total:
            interrupted = True
            saved = checkpoint(ctx, trainer, step)
            ctx.log(f"stopped at step {step}; checkpoint {saved}")
        elif save_every and step % save_every == 0 and step < total:
            saved = checkpoint(ctx, trainer, step)

    profiler.close()
    hf_dir, memory = None, {}
    if not interrupted:
        saved, hf_dir, memory = _finish(ctx, trainer, main, metrics, step, saved)
    if snapshot:
        dump_snapshot(ctx.log)
    metrics.close()
    trainer.close()
    status = "interrupted" if interrupted else "completed"
    if d.is_main:
        write_json_atomic(paths.summary, _summary(trainer, status, step, total, saved, hf_dir, memory))
    barrier()
    return status


def _finish(ctx: RunContext, trainer: Trainer, main: TrainEngine, metrics: MetricsLogger, step: int, saved):
    """The end of a completed run: the last evaluation (unless it just ran), the last step's checkpoint
    (unless it was just saved) and the HF export; returns the checkpoint, the HF directory (or None) and, on
    CUDA, the memory before and after that save."""
    cfg, paths = ctx.cfg, ctx.paths
    every = cfg.train.eval_every
    if trainer.has_eval and (not every or step % every):
        metrics.log(trainer.evaluate(step))
    memory = {}
    if saved is None or saved.name != step_name(step):
        before = cuda_memory_now(main.device)
        saved = checkpoint(ctx, trainer, step)
        memory = {"before_final_save": before, "after_final_save": cuda_memory_now(main.device)} if before else {}
    hf_dir = None
    if cfg.checkpoint.export_hf:
        dtype = config_dtype(json.loads((paths.model_meta / "config.json").read_text()))
        hf_dir = main.export_hf(paths.hf, paths.model_meta, dtype=dtype)
    return saved, hf_dir, memory


def _summary(trainer: Trainer, status: str, step: int, total: int, saved, hf_dir, memory: dict) -> dict:
    """summary.json: how the run ended, where its checkpoint and HF export are, and the trainer's own lines."""
    return {
        "status": status,
        "step": step,
        "total_steps": total,
        "checkpoint": str(saved) if saved else None,
        "hf": str(hf_dir) if hf_dir else None,
        **({"cuda_memory": memory} if memory else {}),
        **trainer.summary(),
    }
