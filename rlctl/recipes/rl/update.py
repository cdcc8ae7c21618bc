"""The PPO-style update, ONE loop for the actor and the critic: ``algo.ppo_epochs`` passes over the
step's mini-batches, one optimizer step per mini-batch, every loss aggregated with the mini-batch's
global token and sequence counts (all-reduced over the data-parallel replicas), so the update does
not depend on the number of ranks. Only the loss function differs: :func:`policy_loss_fn` (the
policy loss ``algo.policy_loss`` names, with its own defaults unless the user set a key) or
:func:`value_loss_fn`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from rlctl.algos import (
    PolicyLossContext,
    aggregate,
    entropy_from_logits,
    kl_estimate,
    logprobs_from_logits,
    value_loss,
)
from rlctl.algos.distill import divergence_metric, generalized_jsd
from rlctl.algos.vocab_parallel import VocabSlice, vocab_parallel_jsd
from rlctl.config import RunConfig
from rlctl.data.packing import MicroBatch
from rlctl.engines.base import (
    LossFn,
    TrainEngine,
    VocabParallelLogits,
    full_logits,
    response_pairs,
    response_tokens,
)
from rlctl.recipes.rl.batch import RolloutBatch, can_share_prefix, micro_batches
from rlctl.recipes.rl.spec import AlgoSpec
from rlctl.recipes.rl.teacher import StagedTeacher
from rlctl.runtime.dist import all_reduce_sum, global_sums

#: ``algo.distill=full``: the teacher engine (a :class:`~rlctl.recipes.rl.teacher.StagedTeacher` in pipeline
#: stages), its weight (``algo.teacher_weight``) and the divergence's ``algo.distill_beta`` (1: the reverse KL)
FullTeacher = tuple[TrainEngine | StagedTeacher, float, float]


class Sums:
    """Local sums of metrics, reduced over the data-parallel replicas once at the end. The keys are
    fixed up front: a replica without samples must still take part in the reduction with the same keys."""

    def __init__(self, *keys: str) -> None:
        self.values: dict[str, float] = dict.fromkeys(keys, 0.0)

    def add(self, key: str, value: float | torch.Tensor) -> None:
        self.values[key] += float(value)

    def add_all(self, results: list[dict]) -> None:
        """Add the metric dicts that loss functions returned (one per micro-batch)."""
        for result in results:
            for key, value in result.items():
                self.add(key, value)

    def reduce(self, device: torch.device, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        return global_sums(self.values, device, group)


def _denominators(batch: RolloutBatch, rows: list[int], group: dist.ProcessGroup | None) -> tuple[float, float]:
    """Response tokens and sequences of one mini-batch over all data-parallel replicas."""
    idx = torch.tensor(rows, dtype=torch.int64, device=batch.mask.device)
    tokens, seqs = all_reduce_sum(
        [float(batch.mask[idx].sum()) if rows else 0.0, float(len(rows))], batch.mask.device, group
    )
    return tokens, seqs


def _minis(batch: RolloutBatch) -> list[list[int]]:
    """This replica's rows of each mini-batch (some may be empty); the same count on every rank. A row
    without loss tokens (DAPO's overlong filtering zeroed its mask) is left out: it counts nowhere."""
    mini = batch.mini.tolist()
    live = (batch.mask.sum(-1) > 0).tolist()
    return [[i for i in range(len(batch)) if mini[i] == k and live[i]] for k in range(batch.num_minis)]


def ppo_update(
    engine: TrainEngine,
    batch: RolloutBatch,
    algo: AlgoSpec,
    make_loss_fn: Callable[[dict], LossFn],
    keys: tuple[str, ...],
    *,
    budget: int,
    pad_id: int,
    share_prefix: bool = False,
    before: Callable[[list[MicroBatch]], None] | None = None,
) -> tuple[dict[str, float], list[float]]:
    """``algo.ppo_epochs`` passes over the mini-batches, one optimizer step each. ``make_loss_fn(denoms)``
    gives the engine's loss for one mini-batch (``denoms``: global_tokens, global_seqs, norm_len); ``before``
    runs on its micro-batches before the engine's pass (a staged teacher's logits: :class:`StagedTeacher`).
    Returns the metric sums ``keys`` (+ "tokens") over all replicas, and the grad norm of every step."""
    device, group = batch.mask.device, engine.dp_group
    sums = Sums(*keys, "tokens")
    grad_norms: list[float] = []
    for _ in range(algo.ppo_epochs):
        for rows in _minis(batch):
            tokens, seqs = _denominators(batch, rows, group)
            denoms = {"global_tokens": tokens, "global_seqs": seqs, "norm_len": algo.norm_len}
            micro = micro_batches(batch, rows, budget=budget, pad_id=pad_id, device=device, share_prefix=share_prefix)
            if before is not None:
                before(micro)
            sums.add_all(engine.forward_backward(micro, make_loss_fn(denoms)))
            grad_norms.append(engine.step())  # the global norm, the same on every rank
            sums.add("tokens", float(batch.mask[rows].sum()) if rows else 0.0)
    return sums.reduce(device, group), grad_norms


# the rollout-correction metrics logged per step: token-weighted means over the update's micro-batches
CORRECTION_METRICS = ("is_mean", "is_ess", "is_frac_high", "is_frac_low", "mismatch_kl_k1", "mismatch_kl_k3")


def correction_weights(
    algo: AlgoSpec, old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The importance weights trainer / rollout of ``algo.correction`` on one micro-batch (None when off)
    and their metrics as sums over its tokens (``corr/<name>``)."""
    c = algo.correction
    if c is None or not mask.bool().any():
        return None, {}
    weights, m = c.weights(old_logp - rollout_logp, mask)
    n_tok = mask.sum()
    return weights, {key: m[key.removeprefix("corr/")] * n_tok for key in _corr_keys(algo)}


def _corr_keys(algo: AlgoSpec) -> tuple[str, ...]:
    c = algo.correction
    if c is None:
        return ()
    done = "is_frac_truncated" if c.mode == "tis" else "is_frac_masked"
    return tuple(f"corr/{k}" for k in (*CORRECTION_METRICS, done, "is_seq_rejected"))


def _loss_keys(algo: AlgoSpec) -> tuple[str, ...]:
    """The policy loss's token-mean metrics logged as ``pg/<name>``: every loss's two and its own."""
    return ("clip_frac", "approx_kl", *algo.policy.loss.metrics)


def full_distill_loss(
    teacher: FullTeacher, logits, mb: MicroBatch, mask: torch.Tensor, algo: AlgoSpec, denoms: dict
) -> tuple[torch.Tensor, dict]:
    """``algo.distill=full``: the teacher's forward of this micro-batch only (its logits at the response
    positions, no gradient), the exact divergence over the vocabulary at each sampled position (the reverse KL at
    ``algo.distill_beta`` 1, :func:`~rlctl.algos.distill.generalized_jsd`), aggregated like the policy loss over
    the loss mask; times the teacher's weight. Metric: the divergence summed over the tokens.
    Under Ulysses sp both models' logits are the same sequence shard (:func:`response_pairs`); where the teacher
    splits its logits over the vocabulary (Megatron's TP) each rank reads its columns of both models'
    (:func:`~rlctl.algos.vocab_parallel.vocab_parallel_jsd`)."""
    engine, weight, beta = teacher
    split = isinstance(logits, VocabParallelLogits)
    vocab = logits.vocab_size if split else logits.shape[-1] if isinstance(logits, torch.Tensor) else None
    shard = engine.vocab_shard(vocab) if vocab else None
    if shard is None:
        with torch.no_grad():
            t_out = engine.forward_micro(mb)
        student = full_logits(logits) if split else logits
        flat = response_pairs(student, t_out, mb, lambda s, t: generalized_jsd(s, t, algo.temperature, beta))
    else:  # this rank's vocabulary columns of both models' logits (the student's never gathered on Megatron)
        with torch.no_grad():  # (the teacher's every position is dropped here, its response positions kept)
            t_logits = mb.at_response(engine.forward_vocab_shard(mb))[:, : shard.width]
        if split and (logits.shard.start, logits.shard.width) != (shard.start, shard.width):
            raise RuntimeError(f"the teacher's vocabulary columns {shard} are not the student's {logits.shard}")
        student = mb.at_response(logits.local if split else logits[..., shard.start : shard.start + shard.width])
        flat = vocab_parallel_jsd(student, t_logits, algo.temperature, beta, shard.group)
    kl = mb.to_matrix(flat)
    loss = aggregate(kl, mask, algo.policy.agg, **denoms)
    return weight * loss, {divergence_metric(beta): (kl.detach() * mask).sum()}


def policy_loss_fn(
    batch: RolloutBatch, algo: AlgoSpec, denoms: dict, kl_loss_coef: float, teacher: FullTeacher | None = None
) -> LossFn:
    """The engine's ``loss_fn`` for one mini-batch of the actor update:
    ``pg + kl_loss_coef * agg(kl(logp, ref)) - entropy_coef * agg(entropy)``, every term aggregated with
    the mini-batch's global token / sequence counts (``denoms``); returns the loss and its metrics. With
    ``teacher`` (``algo.distill=full``) the weighted full-vocabulary reverse KL to the teacher is added."""
    a, temperature, pl = algo, algo.temperature, algo.policy

    def per_token(sel: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """log-probs; the entropy the skipped log-prob pass would report (from the same log-softmax, no
        gradient); the entropy bonus's (with gradient). None where not needed."""
        if isinstance(sel, VocabSlice):  # Megatron's TP: both from one vocab-parallel pass, both differentiable
            flat, entropy = sel.logprobs(labels, temperature)
            return flat, entropy.detach() if batch.old_logp is None else None, entropy if a.entropy_coef else None
        entropy = None
        if batch.old_logp is None:
            flat, entropy = logprobs_from_logits(sel, labels, temperature, with_entropy=True)
        else:
            flat = logprobs_from_logits(sel, labels, temperature)
        bonus = entropy_from_logits(sel.float() / temperature) if a.entropy_coef else None
        return flat, entropy, bonus

    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        if mb.dummy:
            if teacher is not None:  # the teacher's forward is collective too
                with torch.no_grad():
                    teacher[0].forward_micro(mb)
            return logits.sum() * 0.0, {}  # a backward pass keeps this replica in the collectives
        mask = mb.take(batch.mask)
        flat, entropy, bonus = response_tokens(logits, mb, per_token)  # at the positions that predict responses
        logp = mb.to_matrix(flat)
        # one optimizer step per batch: the policy before the update is this forward's own (no extra pass)
        old_logp = logp.detach() if batch.old_logp is None else mb.take(batch.old_logp)
        behav_logp = mb.take(batch.rollout_logp)
        weights, corr_stats = correction_weights(algo, old_logp, behav_logp, mask)
        advantages = mb.take(batch.advantages)
        settings = {"clip_low": pl.clip_low, "clip_high": pl.clip_high, "dual_clip": pl.dual_clip, "agg": pl.agg}
        loss, m = pl.call(
            PolicyLossContext(
                logp, old_logp, advantages, mask, **settings, **denoms, is_weights=weights, behav_logp=behav_logp
            )
        )
        n_tok = mask.sum()
        stats = {"pg/loss": loss.detach(), **{f"pg/{k}": m[k] * n_tok for k in _loss_keys(algo)}, **corr_stats}
        if batch.old_logp is None:  # what the skipped log-prob pass reported
            stats["logprob_diff"] = ((logp.detach() - mb.take(batch.rollout_logp)).abs() * mask).sum()
            stats["entropy"] = (mb.to_matrix(entropy) * mask).sum()
        if kl_loss_coef:
            kl_loss = aggregate(kl_estimate(logp, mb.take(batch.ref_logp), a.kl_kind), mask, pl.agg, **denoms)
            loss = loss + kl_loss_coef * kl_loss
            stats["kl_loss"] = kl_loss.detach()
        if a.entropy_coef:
            loss = loss - a.entropy_coef * aggregate(mb.to_matrix(bonus), mask, pl.agg, **denoms)
        if teacher is not None:
            term, distill_stats = full_distill_loss(teacher, logits, mb, mask, algo, denoms)
            loss, stats = loss + term, {**stats, **distill_stats}
        return loss, stats

    return loss_fn


def single_step(batch: RolloutBatch, algo: AlgoSpec) -> bool:
    """The batch gets exactly one optimizer step: its old log-probs are the update's own forward (detached)."""
    return algo.ppo_epochs == 1 and batch.num_minis == 1


def skips_old_logprobs(cfg: RunConfig) -> bool:
    """Every step of the run skips the actor's old-log-prob pass (``RLTrainer.old_logprobs``): no reference
    model (``algo.kl_coef`` 0) and :func:`single_step` batches (one PPO epoch, the batch one mini-batch)."""
    a = cfg.algo
    one_mini = not a.mini_batch_size or a.mini_batch_size >= cfg.train.batch_size
    return a.kl_coef <= 0 and a.ppo_epochs == 1 and one_mini


def update_actor(
    engine: TrainEngine,
    batch: RolloutBatch,
    algo: AlgoSpec,
    *,
    budget: int,
    pad_id: int,
    kl_loss_coef: float = 0.0,
    share_prefix: bool | None = None,
    teacher: FullTeacher | None = None,
) -> dict[str, float]:
    """The policy update (loss: :func:`policy_loss_fn`). Without ``batch.old_logp`` (allowed only for
    :func:`single_step` batches) the old log-probs are the update's own, and it reports what the log-prob
    pass would have: rollout/logprob_diff and entropy. ``share_prefix``: as in compute_logprobs."""
    if batch.old_logp is None and not single_step(batch, algo):
        raise ValueError("old log-probs are needed when a batch gets more than one optimizer step")
    if share_prefix is None:
        share_prefix = engine.shares_prefix and can_share_prefix(batch)
    s, grad_norms = ppo_update(
        engine,
        batch,
        algo,
        lambda denoms: policy_loss_fn(batch, algo, denoms, kl_loss_coef, teacher),
        (
            "pg/loss",
            *(f"pg/{k}" for k in _loss_keys(algo)),
            "kl_loss",
            "logprob_diff",
            "entropy",
            *([divergence_metric(teacher[2])] if teacher is not None else []),
            *_corr_keys(algo),
        ),
        budget=budget,
        pad_id=pad_id,
        share_prefix=share_prefix,
        before=teacher[0].fill if teacher is not None and isinstance(teacher[0], StagedTeacher) else None,
    )
    steps = len(grad_norms)
    out = {
        "pg/loss": s["pg/loss"] / steps,
        "grad_norm": sum(grad_norms) / steps,
        **{f"pg/{k}": s[f"pg/{k}"] / max(1.0, s["tokens"]) for k in _loss_keys(algo)},
    }
    if kl_loss_coef:
        out["kl_loss"] = s["kl_loss"] / steps
    for key in _corr_keys(algo):
        out[key] = s[key] / max(1.0, s["tokens"])
    if teacher is not None:  # the mean exact divergence per token over the update's passes
        key = divergence_metric(teacher[2])
        out[key] = s[key] / max(1.0, s["tokens"])
    if batch.old_logp is None:
        out["rollout/logprob_diff"] = s["logprob_diff"] / max(1.0, s["tokens"])
        out["entropy"] = s["entropy"] / max(1.0, s["tokens"])
    return out


def value_loss_fn(batch: RolloutBatch, algo: AlgoSpec, denoms: dict) -> LossFn:
    """The critic's ``loss_fn`` for one mini-batch: the clipped value loss on the returns, aggregated
    (as the policy loss) with the mini-batch's global token / sequence counts."""
    a, agg = algo, algo.policy.agg

    def loss_fn(v: torch.Tensor, mb: MicroBatch):
        if mb.dummy:
            return v.sum() * 0.0, {}
        mask = mb.take(batch.mask)
        values = mb.to_matrix(mb.at_response(v))
        loss, m = value_loss(
            values,
            mb.take(batch.values),
            mb.take(batch.returns),
            mask,
            clip=a.vf_clip or None,
            agg=agg,
            **denoms,
        )
        return loss, {"critic/value_loss": loss.detach(), "critic/vf_clip_frac": m["vf_clip_frac"] * mask.sum()}

    return loss_fn


def update_critic(
    critic: TrainEngine, batch: RolloutBatch, algo: AlgoSpec, *, budget: int, pad_id: int
) -> dict[str, float]:
    """The critic update (loss: :func:`value_loss_fn`)."""
    s, grad_norms = ppo_update(
        critic,
        batch,
        algo,
        lambda denoms: value_loss_fn(batch, algo, denoms),
        ("critic/value_loss", "critic/vf_clip_frac"),
        budget=budget,
        pad_id=pad_id,
    )
    steps = len(grad_norms)
    return {
        "critic/value_loss": s["critic/value_loss"] / steps,
        "critic/vf_clip_frac": s["critic/vf_clip_frac"] / max(1.0, s["tokens"]),
        "critic/grad_norm": sum(grad_norms) / steps,
    }
