"""Supervised fine-tuning: ``python -m rlctl.recipes.sft --run-dir RUN`` (under torchrun).

The engine is the plan's (FSDP2 or Megatron, :func:`rlctl.engines.build_engine`). Per optimizer
step: the global batch (``train.batch_size`` sequences, fixed by the step number alone) is cut into
packed micro-batches, dealt over the data-parallel replicas (every rank with FSDP; with Megatron the
tensor/pipeline ranks of a replica get the same ones), and the loss is the per-token mean
cross-entropy over the assistant tokens of the WHOLE global batch (each replica divides its summed
loss by the global count of loss tokens). So neither the number of processes nor the number of
micro-batches changes the update, and a run resumed on another number of processes continues the
same trajectory.
"""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlctl.data.packing import StepSampler, rank_micro_batches
from rlctl.data.sft import IGNORE, SFTData, build_sft_data
from rlctl.engines import EngineSpec, build_engine
from rlctl.engines.base import (
    TrainEngine,
    load_tokenizer,
    model_source,
    write_model_meta,
)
from rlctl.engines.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from rlctl.errors import UserError
from rlctl.formats.hf_writer import config_dtype
from rlctl.metrics import MetricsLogger
from rlctl.recipes.common import (
    RunContext,
    all_reduce_sum,
    barrier,
    recipe_main,
    rng_state,
    set_rng_state,
    write_json_atomic,
)

DUMP_LOGITS_ENV = "RLCTL_DUMP_LOGITS"  # test hook: save the final model's logits on a fixed input


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over positions whose label is not -100 (computed in fp32)."""
    keep = labels != IGNORE
    if not keep.any():
        return logits.sum() * 0.0  # still runs backward through the model (FSDP needs it on every rank)
    return F.cross_entropy(logits[keep].float(), labels[keep], reduction="sum")


class SFTTrainer:
    def __init__(self, ctx: RunContext, engine: TrainEngine, data: SFTData, sampler: StepSampler, *, pad_id: int):
        cfg = ctx.cfg
        self.ctx, self.engine, self.data, self.sampler, self.pad_id = ctx, engine, data, sampler, pad_id
        self.packing = cfg.data.packing
        self.micro_batch_size = cfg.train.micro_batch_size or getattr(ctx.plan, "micro_batch_size", 0) or 1
        self.budget = cfg.train.max_tokens_per_micro_batch or self.micro_batch_size * cfg.train.max_len
        if self.packing and self.budget < cfg.train.max_len:
            raise UserError(
                f"train.max_tokens_per_micro_batch={self.budget} is below train.max_len="
                f"{cfg.train.max_len}; a sequence must fit in one micro-batch"
            )

    def _micro_batches(self, batch):
        """This replica's share of ``batch``, on the engine's device."""
        e = self.engine
        micro = rank_micro_batches(
            batch,
            e.dp_rank,
            e.dp_size,
            packing=self.packing,
            budget=self.budget,
            micro_batch_size=self.micro_batch_size,
            pad_id=self.pad_id,
        )
        return [mb.to(e.device) for mb in micro]

    def _sum_over_replicas(self, value: float) -> float:
        (total,) = all_reduce_sum([value], self.engine.device, self.engine.dp_group)
        return total

    def train_step(self, step: int) -> dict:
        """One optimizer step (0-based ``step``); returns its metrics (the same on every rank)."""
        start = time.perf_counter()
        batch = [self.data.train[i] for i in self.sampler.indices(step)]
        loss_tokens = sum(ex.num_loss_tokens for ex in batch)  # global: every rank sees the batch

        def loss_fn(logits, mb):
            loss_sum = token_loss_sum(logits, mb.labels)
            return loss_sum / loss_tokens, loss_sum

        lr = self.engine.lr
        loss_sums = self.engine.forward_backward(self._micro_batches(batch), loss_fn)
        grad_norm = self.engine.step()
        total_sum = self._sum_over_replicas(sum(float(x) for x in loss_sums))
        elapsed = time.perf_counter() - start
        tokens = sum(len(ex) for ex in batch)
        return {
            "step": step + 1,
            "total_steps": self.engine.total_steps,
            "epoch": round((step + 1) / self.sampler.steps_per_epoch, 4),
            "loss": total_sum / loss_tokens,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "loss_tokens": loss_tokens,
            "tokens_per_s": tokens / elapsed,
            "time/step": elapsed,
        }

    def evaluate(self) -> float:
        """Per-token loss over the whole validation set."""
        self.engine.train(False)
        local_sum = 0.0
        bs = self.ctx.cfg.train.batch_size
        for k in range(0, len(self.data.val), bs):
            micro = self._micro_batches(self.data.val[k : k + bs])
            sums = self.engine.forward_backward(
                micro, lambda logits, mb: (None, token_loss_sum(logits, mb.labels)), forward_only=True
            )
            local_sum += sum(float(x) for x in sums)
        self.engine.train(True)
        return self._sum_over_replicas(local_sum) / sum(ex.num_loss_tokens for ex in self.data.val)


def run(ctx: RunContext) -> None:
    cfg, paths, d = ctx.cfg, ctx.paths, ctx.dist
    source = model_source(cfg.model.name, random_init=cfg.model.random_init)
    tokenizer = load_tokenizer(source)
    data = build_sft_data(cfg, tokenizer)
    ctx.log(f"data: {data.report.summary()}; {len(data.train)} train / {len(data.val)} val sequences")
    sampler = StepSampler(len(data.train), cfg.train.batch_size, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    total_steps = cfg.train.max_steps or cfg.train.epochs * sampler.steps_per_epoch
    engine = build_engine(EngineSpec.from_config(cfg), cfg, role="actor", total_steps=total_steps, source=source)
    trainer = SFTTrainer(ctx, engine, data, sampler, pad_id=tokenizer.pad_token_id)
    if d.is_main:
        write_model_meta(paths.model_meta, engine.hf_config, tokenizer, source)
    barrier()

    start = 0
    resume_from = resolve_resume(cfg.checkpoint.resume, paths.root)
    if resume_from is not None:
        state, rng = load_checkpoint(resume_from, {"": engine})
        start = state["step"]
        if rng is not None:
            set_rng_state(rng)
        if state.get("data", {}).get("num_train") != len(data.train):
            ctx.log(
                f"warning: the data changed since {resume_from.name} (train sequences "
                f"{state.get('data', {}).get('num_train')} -> {len(data.train)}); the data order differs"
            )
        ctx.log(
            f"resumed from {resume_from} at step {start} (saved by {state.get('world_size')} processes, "
            f"now {d.world_size})"
        )
    elif cfg.checkpoint.resume == "auto":
        ctx.log("resume=auto: no checkpoint found, starting from step 0")

    metrics = MetricsLogger(
        paths.metrics,
        backends=cfg.log.backends,
        enabled=d.is_main,
        project=cfg.log.project,
        run_name=cfg.log.run_name,
        config=cfg.to_dict(),
    )

    def checkpoint(step: int):
        trainer_state = {
            "method": "sft",
            "epoch": sampler.epoch_of(step),
            "total_steps": total_steps,
            "data": {
                "num_train": len(data.train),
                "batch_size": sampler.batch_size,
                "steps_per_epoch": sampler.steps_per_epoch,
                "seed": cfg.train.seed,
            },
        }
        return save_checkpoint(
            paths.checkpoints,
            step,
            {"": engine},
            trainer_state=trainer_state,
            meta_dir=paths.model_meta,
            rng_state=rng_state(),
            keep_last=cfg.checkpoint.keep_last,
        )

    saved = None
    step = start
    interrupted = False
    while step < total_steps:
        record = trainer.train_step(step)
        step += 1
        if step % cfg.log.every == 0 or step == total_steps:
            metrics.log(record)
        if data.val and cfg.train.eval_every and step % cfg.train.eval_every == 0:
            metrics.log({"step": step, "kind": "eval", "val_loss": trainer.evaluate()})
        (stop_votes,) = all_reduce_sum([float(ctx.stop.local(step))], engine.device)
        if stop_votes > 0 and step < total_steps:
            interrupted = True
            saved = checkpoint(step)
            ctx.log(f"stopped at step {step}; checkpoint {saved}")
            break
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < total_steps:
            saved = checkpoint(step)

    hf_dir = None
    if not interrupted:
        if data.val and (not cfg.train.eval_every or step % cfg.train.eval_every):
            metrics.log({"step": step, "kind": "eval", "val_loss": trainer.evaluate()})
        if saved is None or saved.name != f"step_{step:06d}":
            saved = checkpoint(step)
        if os.environ.get(DUMP_LOGITS_ENV):
            _dump_logits(engine, data, paths.root / "debug_logits.pt")
        if cfg.checkpoint.export_hf:
            dtype = config_dtype(json.loads((paths.model_meta / "config.json").read_text()))
            hf_dir = engine.export_hf(paths.hf, paths.model_meta, dtype=dtype)
    metrics.close()
    if d.is_main:
        write_json_atomic(
            paths.summary,
            {
                "status": "interrupted" if interrupted else "completed",
                "step": step,
                "total_steps": total_steps,
                "checkpoint": str(saved) if saved else None,
                "hf": str(hf_dir) if hf_dir else None,
                "data": data.report.to_dict(),
                "val_data": data.val_report.to_dict() if data.val_report else None,
            },
        )


def _dump_logits(engine: TrainEngine, data: SFTData, path) -> None:
    """Logits of the trained (sharded) model on the first training sequence, for the export test."""
    ids = torch.as_tensor(data.train[0].input_ids, dtype=torch.long)[None].to(engine.device)
    mb = SimpleNamespace(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=engine.device)[None])
    engine.train(False)
    (logits,) = engine.forward_backward([mb], lambda logits, mb: (None, logits), forward_only=True)
    if dist.get_rank() == 0:
        torch.save({"input_ids": ids.cpu(), "logits": logits.float().cpu()}, path)


if __name__ == "__main__":
    recipe_main(run)
