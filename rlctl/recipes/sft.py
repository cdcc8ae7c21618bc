"""Supervised fine-tuning: ``python -m rlctl.recipes.sft --run-dir RUN`` (under torchrun).

The engine is the plan's (FSDP2 or Megatron, :func:`rlctl.engines.build_engine`). Per optimizer
step: the global batch (``train.batch_size`` sequences, fixed by the step number alone) is cut into
packed micro-batches, dealt over the data-parallel replicas (every rank with FSDP; with Megatron the
tensor/pipeline ranks of a replica get the same ones), and the loss is the per-token mean
cross-entropy over the assistant tokens of the WHOLE global batch (each replica divides its summed
loss by the global count of loss tokens). So neither the number of processes nor the number of
micro-batches changes the update, and a run resumed on another number of processes continues the
same trajectory. The loop around the steps (resume, eval, checkpoints, export, summary.json) is
:func:`rlctl.runtime.fit.fit`, the same as for GRPO and PPO.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlctl.algos import logprobs_from_logits
from rlctl.config import total_steps
from rlctl.data.packing import MicroBatch, StepSampler, rank_micro_batches
from rlctl.data.sft import IGNORE, SFTData, build_sft_data, use_chat_template
from rlctl.engines import EngineSpec, build_engine
from rlctl.engines.base import (
    TrainEngine,
    VocabParallelLogits,
    full_logits,
    load_tokenizer,
    load_vision_processor,
    model_source,
    position_tokens,
    write_model_meta,
)
from rlctl.errors import UserError
from rlctl.runtime.dist import all_reduce_sum, barrier
from rlctl.runtime.entry import RunContext, recipe_main
from rlctl.runtime.fit import fit

DUMP_LOGITS_ENV = "RLCTL_DUMP_LOGITS"  # test hook: save the final model's logits on a fixed input


def token_loss_sum(logits, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over positions whose label is not -100 (computed in fp32). ``logits``: an
    engine's output (under sequence parallelism each rank computes its positions', see position_tokens)."""
    keep = labels != IGNORE
    if not keep.any():
        return logits.sum() * 0.0  # still runs backward through the model (FSDP needs it on every rank)
    if isinstance(logits, torch.Tensor):
        return F.cross_entropy(logits[keep].float(), labels[keep], reduction="sum")
    if isinstance(logits, VocabParallelLogits):  # Megatron's TP: the vocabulary is never gathered
        return -logprobs_from_logits(logits.rows(logits.local[keep]), labels[keep]).sum()
    per_position = position_tokens(
        logits, labels, lambda rows, lab: F.cross_entropy(rows.float(), lab, reduction="none", ignore_index=IGNORE)
    )
    return per_position.sum()


def sft_loss_sum(output, mb: MicroBatch) -> torch.Tensor:
    """A micro-batch's summed cross-entropy at its labelled positions: where the engine ran the LM head at
    ``mb.keep_cols`` only (:func:`rlctl.data.packing.labelled_columns`), its labels are read there."""
    return token_loss_sum(*mb.at_labelled(output, mb.labels))


class SFTTrainer:
    def __init__(
        self,
        ctx: RunContext,
        engine: TrainEngine,
        data: SFTData,
        sampler: StepSampler,
        *,
        pad_id: int,
        total_steps: int,
    ):
        cfg = ctx.cfg
        self.ctx, self.engine, self.data, self.sampler, self.pad_id = ctx, engine, data, sampler, pad_id
        self.total_steps = total_steps
        self.packing = cfg.data.packing
        self.micro_batch_size = cfg.train.micro_batch_size or 1  # the plan's choice is in the resolved config
        self.budget = cfg.train.max_tokens_per_micro_batch or self.micro_batch_size * cfg.train.max_len
        if self.packing and self.budget < cfg.train.max_len:
            raise UserError(
                f"train.max_tokens_per_micro_batch={self.budget} is below train.max_len="
                f"{cfg.train.max_len}; a sequence must fit in one micro-batch"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    @property
    def num_examples(self) -> int:
        return len(self.data.train)

    @property
    def has_eval(self) -> bool:
        return bool(self.data.val)

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
            keep_labelled=True,  # the LM head at the labelled positions only: prompts and padding skip it
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
            loss_sum = sft_loss_sum(logits, mb)
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

    def evaluate(self, step: int) -> dict:
        """Per-token loss over the whole validation set."""
        self.engine.train(False)
        local_sum = 0.0
        bs = self.ctx.cfg.train.batch_size
        for k in range(0, len(self.data.val), bs):
            micro = self._micro_batches(self.data.val[k : k + bs])
            sums = self.engine.forward_backward(
                micro, lambda logits, mb: (None, sft_loss_sum(logits, mb)), forward_only=True
            )
            local_sum += sum(float(x) for x in sums)
        self.engine.train(True)
        val_loss = self._sum_over_replicas(local_sum) / sum(ex.num_loss_tokens for ex in self.data.val)
        return {"step": step, "kind": "eval", "val_loss": val_loss}

    # what rlctl.runtime.fit needs

    def engines(self) -> dict[str, TrainEngine]:
        return {"": self.engine}

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def summary(self) -> dict:
        return {
            "data": self.data.report.to_dict(),
            "val_data": self.data.val_report.to_dict() if self.data.val_report else None,
        }

    def close(self) -> None:
        if os.environ.get(DUMP_LOGITS_ENV):
            _dump_logits(self.engine, self.data, self.ctx.paths.root / "debug_logits.pt")


def run(ctx: RunContext) -> None:
    cfg, paths, d = ctx.cfg, ctx.paths, ctx.dist
    source = model_source(cfg.model.name, random_init=cfg.model.random_init)
    tokenizer = use_chat_template(load_tokenizer(source), cfg)
    vision = load_vision_processor(source, tokenizer)  # None for a text model
    data = build_sft_data(cfg, tokenizer, cache_dir=paths.data_cache, log=ctx.log, vision=vision)
    ctx.log(f"data: {data.report.summary()}; {len(data.train)} train / {len(data.val)} val sequences")
    sampler = StepSampler(len(data.train), cfg.train.batch_size, seed=cfg.train.seed, shuffle=cfg.data.shuffle)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    engine = build_engine(EngineSpec.from_config(cfg), role="actor", total_steps=steps, source=source)
    trainer = SFTTrainer(ctx, engine, data, sampler, pad_id=tokenizer.pad_token_id, total_steps=steps)
    if d.is_main:
        write_model_meta(paths.model_meta, engine.hf_config, tokenizer, source, vision=vision)
    barrier()
    fit(ctx, trainer)


def _dump_logits(engine: TrainEngine, data: SFTData, path) -> None:
    """Logits of the trained (sharded) model on the first training sequence, for the export test."""
    ids = torch.as_tensor(data.train[0].input_ids, dtype=torch.long)[None].to(engine.device)
    positions = torch.arange(ids.shape[1], device=engine.device)[None]
    mb = MicroBatch(input_ids=ids, position_ids=positions, labels=ids)
    engine.train(False)
    (logits,) = engine.forward_backward([mb], lambda logits, mb: (None, full_logits(logits)), forward_only=True)
    if dist.get_rank() == 0:
        torch.save({"input_ids": ids.cpu(), "logits": logits.float().cpu()}, path)


if __name__ == "__main__":
    recipe_main(run)
