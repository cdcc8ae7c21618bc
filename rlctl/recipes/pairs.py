"""What `rlctl dpo` and `rlctl rm` share: a step over whole preference units (pairs, or KTO's rows).

The step's global batch (``train.batch_size`` units, fixed by the step number alone: :class:`StepSampler`) is
cut into micro-batches of whole units (a pair's chosen and rejected in the same one, packed in one row with
per-document attention, dpo's with the pair's prompt once: :func:`rlctl.data.pref_batches.unit_micro_batches`) and
dealt over the data-parallel replicas. A unit's loss is divided by the global number of units, so the update is
the mean over the batch for any number of processes or micro-batches. Each micro-batch's loss function returns,
beside its share of the loss, a vector of SUMS (the metrics' numerators), added over micro-batches and replicas
and divided by the method's counts: the logged metrics are the whole batch's. The loop around the steps is
:func:`rlctl.runtime.fit.fit`, as for sft.
"""

from __future__ import annotations

import time

import torch

from rlctl.config import total_steps
from rlctl.config.algorithm import pair_budget
from rlctl.data.packing import StepSampler
from rlctl.data.pref_batches import unit_micro_batches
from rlctl.data.preference import PrefData, Unit
from rlctl.engines.base import TrainEngine
from rlctl.runtime.dist import all_reduce_sum
from rlctl.runtime.entry import RunContext


def micro_batches(
    cfg, units: list[Unit], engine: TrainEngine, pad_id: int, *, share_prompt: bool = False, keep_labelled: bool = False
) -> list:
    """This replica's micro-batches of ``units`` (whole units each; packed, at most
    :func:`rlctl.config.algorithm.pair_budget` tokens), on the engine's device; ``share_prompt``: a unit's
    prompt once, where the engine runs shared-prefix blocks (:func:`rlctl.data.pref_batches.collate_shared`);
    ``keep_labelled``: the LM head at the labelled positions only (a language model's log-probs, not a score)."""
    micro = unit_micro_batches(
        units, engine.dp_rank, engine.dp_size, packing=cfg.data.packing, budget=pair_budget(cfg), pad_id=pad_id,
        per_micro=cfg.train.micro_batch_size or 1, share_prompt=share_prompt and engine.shares_prefix,
        keep_labelled=keep_labelled,
    )  # fmt: skip
    return [mb.to(engine.device) for mb in micro]


class UnitTrainer:
    """The :class:`rlctl.runtime.fit.Trainer` of dpo and rm; a subclass gives :meth:`unit_loss` (a micro-batch's
    share of the loss and its sums, named by :attr:`SUMS`) and :meth:`metrics` (the record from the sums)."""

    SUMS: tuple[str, ...] = ()
    SHARE_PROMPT = False  # a unit's sequences hold their common prompt once (micro_batches)
    KEEP_LABELLED = False  # the logits at the labelled positions only (micro_batches)

    def __init__(self, ctx: RunContext, engine: TrainEngine, data: PrefData, *, pad_id: int):
        cfg = ctx.cfg
        self.ctx, self.engine, self.data, self.pad_id = ctx, engine, data, pad_id
        self.sampler = StepSampler(len(data.train), cfg.train.batch_size, seed=cfg.train.seed, shuffle=cfg.data.shuffle)

    @property
    def total_steps(self) -> int:
        return total_steps(self.ctx.cfg, self.sampler.steps_per_epoch)

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps_per_epoch

    @property
    def num_examples(self) -> int:
        return len(self.data.train)

    @property
    def has_eval(self) -> bool:
        return bool(self.data.val)

    def micro_batches(self, units: list[Unit]):
        return micro_batches(
            self.ctx.cfg,
            units,
            self.engine,
            self.pad_id,
            share_prompt=self.SHARE_PROMPT,
            keep_labelled=self.KEEP_LABELLED,
        )

    def sum_over_replicas(self, results: list[torch.Tensor]) -> dict[str, float]:
        local = torch.stack([r.double() for r in results]).sum(0).tolist() if results else [0.0] * len(self.SUMS)
        return dict(zip(self.SUMS, all_reduce_sum(local, self.engine.device, self.engine.dp_group)))

    # what a subclass gives

    def prepare(self, micro: list, indices: list[int], *, val: bool) -> dict:
        """Attach what the loss needs to ``micro`` (the step's micro-batches of units ``indices``); returns the
        step's constants for :meth:`unit_loss` (e.g. global counts)."""
        return {"units": len(indices)}

    def unit_loss(self, output, mb, step: dict) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def metrics(self, sums: dict[str, float], step: dict) -> dict:
        raise NotImplementedError

    def before_step(self) -> None:
        """Between the backward passes and the optimizer step (rm: the value head's bias is held)."""

    # the steps

    def train_step(self, step: int) -> dict:
        start = time.perf_counter()
        indices = self.sampler.indices(step)
        units = [self.data.train[i] for i in indices]
        micro = self.micro_batches(units)
        consts = self.prepare(micro, indices, val=False)
        lr = self.engine.lr
        results = self.engine.forward_backward(micro, lambda out, mb: self.unit_loss(out, mb, consts))
        self.before_step()
        grad_norm = self.engine.step()
        sums = self.sum_over_replicas(results)
        elapsed = time.perf_counter() - start
        tokens = sum(len(u) for u in units)
        return {
            "step": step + 1,
            "total_steps": self.engine.total_steps,
            "epoch": round((step + 1) / self.sampler.steps_per_epoch, 4),
            **self.metrics(sums, consts),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "tokens_per_s": tokens / elapsed,
            "time/step": elapsed,
        }

    def evaluate(self, step: int) -> dict:
        """The metrics over the whole validation set, TRL's names with ``eval_`` before them (and val_loss)."""
        self.engine.train(False)
        bs, results, units = self.ctx.cfg.train.batch_size, [], len(self.data.val)
        for k in range(0, units, bs):
            indices = list(range(k, min(k + bs, units)))
            micro = self.micro_batches([self.data.val[i] for i in indices])
            consts = self.prepare(micro, indices, val=True)
            consts["units"] = units  # every share over the whole set
            results += self.engine.forward_backward(
                micro, lambda out, mb, c=consts: (None, self.unit_loss(out, mb, c)[1]), forward_only=True
            )
        self.engine.train(True)
        record = self.metrics(self.sum_over_replicas(results), {"units": units})
        out = {"step": step, "kind": "eval", "val_loss": record["loss"]}
        out.update({f"eval_{k}": v for k, v in record.items()})
        return out

    # what rlctl.runtime.fit needs besides

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
        pass
