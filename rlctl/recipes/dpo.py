"""Preference optimization: ``python -m rlctl.recipes.dpo --run-dir RUN`` (under torchrun), FSDP2.

The loss is ``pref.loss``, looked up in :mod:`rlctl.algos.preference` (sigmoid = DPO, ipo, hinge, robust,
simpo, orpo, kto, or a plugin's). A pair's chosen and rejected sequences sit in one micro-batch (packed in one
row, each attending only to itself, their common prompt held once where the engine runs shared-prefix blocks:
:func:`rlctl.data.pref_batches.collate_shared`); a sequence's log-prob is the sum of its response tokens'
log-probs.

The reference (for a loss that has one):

- ``pref.precompute_ref`` (the default): its log-probs of every training and validation unit are computed
  once, before the first step (they never change, so one pass serves every epoch), by a frozen copy that is
  freed before the policy is built; with LoRA by the policy itself with its adapters off;
- otherwise on the fly, every step: a frozen copy kept beside the policy, or with LoRA the policy's base
  (adapters off) again: no second copy either way with LoRA.

KTO (unpaired rows) also estimates ``z0 = max(0, mean(pi - ref))`` over each row's mismatched row (its prompt
with another row's completion, :func:`rlctl.data.preference.with_kl_rows`), per step over the whole batch,
without gradients. Metrics carry TRL's names: rewards/chosen, rewards/rejected, rewards/accuracies,
rewards/margins, logps/chosen, logps/rejected (eval records: eval_ before them).
"""

from __future__ import annotations

import contextlib
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlctl.algos.preference import PrefLoss, get_pref_loss
from rlctl.algos.preference_losses import PrefInputs, kl_estimate
from rlctl.config import total_steps
from rlctl.data.packing import steps_per_epoch
from rlctl.data.pref_batches import UnitMicroBatch
from rlctl.data.preference import PrefData, Unit, build_pref_data
from rlctl.data.sft import IGNORE, use_chat_template
from rlctl.engines import EngineSpec, build_engine
from rlctl.engines.base import TrainEngine, load_tokenizer, model_source, position_tokens, write_model_meta
from rlctl.recipes.pairs import UnitTrainer, micro_batches
from rlctl.runtime.dist import all_reduce_sum, barrier
from rlctl.runtime.entry import RunContext, recipe_main
from rlctl.runtime.fit import fit


def sequence_logps(output, mb) -> torch.Tensor:
    """Each sequence's summed log-prob of its labelled tokens ``[S]`` (0 for a dummy micro-batch, kept in the
    graph so that every rank runs a backward). Where ``mb.keep_cols`` is set the engine computed the logits at
    those columns only (the labelled ones): their labels and sequences are read at the same columns
    (:meth:`~rlctl.data.packing.MicroBatch.at_labelled`)."""
    labels, seq_of = mb.labels, getattr(mb, "seq_of_token", None)
    if isinstance(mb, UnitMicroBatch):
        output, labels, seq_of = mb.at_labelled(output, labels, seq_of.view(labels.shape))
        seq_of = seq_of.reshape(-1)
    tokens = position_tokens(
        output, labels, lambda rows, lab: -F.cross_entropy(rows.float(), lab, reduction="none", ignore_index=IGNORE)
    )
    if not isinstance(mb, UnitMicroBatch):
        return tokens.sum()[None] * 0.0
    keep = seq_of >= 0
    out = torch.zeros(len(mb.seq_len), dtype=tokens.dtype, device=tokens.device)
    return out.index_add(0, seq_of[keep], tokens[keep])


@contextlib.contextmanager
def adapters_off(engine: TrainEngine):
    """The LoRA policy as its frozen base (the reference): every adapter layer skipped. peft's own
    ``disable_adapter()`` also flips the adapters' ``requires_grad``, which FSDP2's sharded parameters must
    keep; its layers read the ``_disable_adapters`` flag set here."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in engine.model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


class Reference:
    """The reference's log-probs: a frozen engine's, or (``lora``) the LoRA policy's with its adapters off."""

    def __init__(self, engine: TrainEngine, cfg, *, pad_id: int, lora: bool = False):
        self.engine, self.cfg, self.pad_id, self.lora = engine, cfg, pad_id, lora

    def forward(self, micro: list) -> list[torch.Tensor]:
        with adapters_off(self.engine) if self.lora else contextlib.nullcontext():
            return self.engine.forward_backward(
                micro, lambda out, mb: (None, sequence_logps(out, mb)), forward_only=True
            )

    def of_micro(self, micro: list) -> None:
        """On the fly: ``mb.ref_logps`` for each micro-batch."""
        for mb, logps in zip(micro, self.forward(micro)):
            mb.ref_logps = logps

    def of_units(self, units: list[Unit]) -> torch.Tensor:
        """Once: ``[N, S]`` log-probs of every unit's sequences (KTO: the row's and its KL row's), the same on
        every rank (each computes its micro-batches', summed over the replicas)."""
        width = max(len(_seqs(u)) for u in units)
        out = torch.zeros(len(units), width, dtype=torch.float64, device=self.engine.device)
        bs = self.cfg.train.batch_size
        for k in range(0, len(units), bs):
            units_k = [Unit(_seqs(u)) for u in units[k : k + bs]]
            micro = micro_batches(self.cfg, units_k, self.engine, self.pad_id, share_prompt=True, keep_labelled=True)
            for mb, logps in zip(micro, self.forward(micro)):
                if isinstance(mb, UnitMicroBatch):
                    out[[k + i for i in mb.units]] = logps.view(len(mb.units), -1).double()
        if dist.get_world_size() > 1:
            dist.all_reduce(out, group=self.engine.dp_group)
        return out.float()


def _seqs(u: Unit) -> tuple:
    """The sequences whose reference log-probs a unit needs: a pair's two; a KTO row and its KL row."""
    return u.seqs if u.kl_seq is None else (*u.seqs, u.kl_seq)


class DPOTrainer(UnitTrainer):
    SUMS = (
        "loss",
        "nll",
        "chosen_tokens",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "chosen_rows",
        "rejected_rows",
    )
    SHARE_PROMPT = True  # a pair's prompt computed once (rlctl.data.pref_batches.collate_shared)
    KEEP_LABELLED = True  # the LM head and its log-softmax at the answer positions only

    def __init__(
        self, ctx: RunContext, engine: TrainEngine, data: PrefData, loss: PrefLoss, *, pad_id: int,
        ref: Reference | None, cached: dict[bool, torch.Tensor],
    ):  # fmt: skip
        super().__init__(ctx, engine, data, pad_id=pad_id)
        p = ctx.cfg.pref
        self.loss = loss
        self.beta = loss.beta if p.beta is None else p.beta
        self.settings = {"beta": self.beta, "label_smoothing": p.label_smoothing, "gamma": p.gamma}
        self.ref = ref  # per step (None: precomputed, or no reference)
        self.cached = cached  # {val: [N, S] reference log-probs} (precompute_ref)

    def prepare(self, micro: list, indices: list[int], *, val: bool) -> dict:
        units = [(self.data.val if val else self.data.train)[i] for i in indices]
        real = [mb for mb in micro if isinstance(mb, UnitMicroBatch)]
        for mb in real if not self.data.paired else ():
            mb.unit_labels = torch.tensor([units[i].label for i in mb.units], device=mb.input_ids.device)
        if self.loss.needs_ref and self.cached:
            for mb in real:  # [k, S] -> the micro-batch's sequences in order (KTO: not its KL rows')
                mb.ref_logps = self.cached[val][[indices[i] for i in mb.units], : len(units[0].seqs)].reshape(-1)
        elif self.loss.needs_ref:
            self.ref.of_micro(micro)
        consts = {"units": len(units), "chosen_tokens": sum(u.seqs[0].num_loss_tokens for u in units)}
        if not self.data.paired:
            consts["kl"] = self._kl(units, indices, val)
        return consts

    def _kl(self, units: list[Unit], indices: list[int], val: bool) -> torch.Tensor:
        """KTO's z0 over the batch's KL rows (no gradients), the same on every rank."""
        micro = self.micro_batches([Unit((u.kl_seq,)) for u in units])
        pol = self.engine.forward_backward(micro, lambda out, mb: (None, sequence_logps(out, mb)), forward_only=True)
        if self.cached:
            ref = [
                self.cached[val][[indices[i] for i in mb.units], 1] if isinstance(mb, UnitMicroBatch) else None
                for mb in micro
            ]
        else:
            ref = self.ref.forward(micro)
        diff = sum(float((p - r).sum()) for p, r, mb in zip(pol, ref, micro) if isinstance(mb, UnitMicroBatch))
        (total,) = all_reduce_sum([diff], self.engine.device, self.engine.dp_group)
        return kl_estimate(torch.tensor(total / len(units)), torch.tensor(0.0)).to(self.engine.device)

    def _inputs(self, logps: torch.Tensor, mb, step: dict) -> PrefInputs:
        if not self.data.paired:
            p = self.ctx.cfg.pref
            return PrefInputs(
                logps, logps, mb.seq_len, mb.seq_len, mb.ref_logps, mb.ref_logps, label=mb.unit_labels,
                kl=step["kl"], desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight,
            )  # fmt: skip
        k = len(mb.units)
        pol, lens = logps.view(k, 2), mb.seq_len.view(k, 2)
        ref = mb.ref_logps.view(k, 2) if self.loss.needs_ref else torch.full_like(pol, float("nan"))
        return PrefInputs(pol[:, 0], pol[:, 1], lens[:, 0], lens[:, 1], ref[:, 0], ref[:, 1])

    def unit_loss(self, output, mb, step: dict) -> tuple[torch.Tensor, torch.Tensor]:
        logps = sequence_logps(output, mb)
        if not isinstance(mb, UnitMicroBatch):
            return logps.sum(), torch.zeros(len(self.SUMS), device=logps.device)
        b = self._inputs(logps, mb, step)
        losses, chosen, rejected = self.loss.fn(b, **self.settings)
        share = losses.sum() / step["units"]
        nll = -b.chosen_logps.sum() if self.loss.nll else logps.new_zeros(())
        if self.loss.nll:
            share = share + nll / max(step["chosen_tokens"], 1)
        good, bad = ~torch.isnan(chosen), ~torch.isnan(rejected)
        paired = self.data.paired
        sums = torch.stack(
            [
                losses.detach().sum(),
                nll.detach(),
                b.chosen_len.sum(),
                chosen[good].sum(),
                rejected[bad].sum(),
                (chosen > rejected).float().sum() if paired else logps.new_zeros(()),
                b.chosen_logps.detach()[good].sum(),
                b.rejected_logps.detach()[bad].sum(),
                good.float().sum(),
                bad.float().sum(),
            ]
        )
        return share, sums

    def metrics(self, sums: dict[str, float], step: dict) -> dict:
        n = max(step["units"], 1)
        good, bad = max(sums["chosen_rows"], 1), max(sums["rejected_rows"], 1)
        chosen, rejected = sums["rewards/chosen"] / good, sums["rewards/rejected"] / bad
        out = {
            "loss": sums["loss"] / n + (sums["nll"] / max(sums["chosen_tokens"], 1) if self.loss.nll else 0.0),
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/margins": chosen - rejected,
            "logps/chosen": sums["logps/chosen"] / good,
            "logps/rejected": sums["logps/rejected"] / bad,
        }
        if self.data.paired:
            out["rewards/accuracies"] = sums["rewards/accuracies"] / n
        if self.loss.nll:
            out["nll_loss"] = sums["nll"] / max(sums["chosen_tokens"], 1)
        if "kl" in step:
            out["kl"] = float(step["kl"])
        return out


def run(ctx: RunContext) -> None:
    cfg, paths, d = ctx.cfg, ctx.paths, ctx.dist
    loss = get_pref_loss(cfg.pref.loss)
    source = model_source(cfg.model.name, random_init=cfg.model.random_init)
    tokenizer = use_chat_template(load_tokenizer(source), cfg)
    pad_id, lora = tokenizer.pad_token_id, cfg.lora.rank > 0
    data = build_pref_data(cfg, tokenizer, paired=loss.paired, loss=f"--loss {loss.name}")
    ctx.log(f"data: {data.report.summary()}; {len(data.train)} train / {len(data.val)} val units ({loss.name})")
    spec = EngineSpec.from_config(cfg)
    ref, cached = None, {}
    if loss.needs_ref and not lora:
        ref = Reference(build_engine(spec, role="ref", trainable=False, source=source), cfg, pad_id=pad_id)
        if cfg.pref.precompute_ref:  # the reference first, freed before the policy exists
            cached, ref = _precompute(ctx, ref, data), None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    steps = total_steps(cfg, steps_per_epoch(len(data.train), cfg.train.batch_size))
    engine = build_engine(spec, role="actor", total_steps=steps, source=source)
    if loss.needs_ref and lora:  # the policy's base, adapters off
        ref = Reference(engine, cfg, pad_id=pad_id, lora=True)
        if cfg.pref.precompute_ref:
            cached, ref = _precompute(ctx, ref, data), None
    trainer = DPOTrainer(ctx, engine, data, loss, pad_id=pad_id, ref=ref, cached=cached)
    if d.is_main:
        write_model_meta(paths.model_meta, engine.hf_config, tokenizer, source)
    barrier()
    fit(ctx, trainer)


def _precompute(ctx: RunContext, ref: Reference, data: PrefData) -> dict[bool, torch.Tensor]:
    ctx.log(f"reference log-probs of {len(data.train) + len(data.val)} units (once, before the first step)")
    out = {False: ref.of_units(data.train)}
    out[True] = ref.of_units(data.val) if data.val else out[False][:0]
    return out


if __name__ == "__main__":
    recipe_main(run)
