"""Policy and value losses, and how a per-token loss matrix is reduced to a scalar.

Every loss takes a per-token matrix ``[B, T]`` and a response ``mask`` and reduces it with
:func:`aggregate`. Metrics are returned as detached 0-d tensors (no device sync); they are local
to the batch given, so average them across ranks for logging.

Data parallelism / gradient accumulation contract
-------------------------------------------------
``aggregate`` divides a local sum by a denominator. By default the denominator is local
(``sum(mask)`` for ``token-mean``, the local ``B`` for the ``seq-mean-*`` modes), which makes the
gradient depend on how the global batch was split across ranks and micro-batches. To get the
gradient of the loss over the *whole* batch instead:

1. before the step, count the tokens and sequences of the whole optimizer batch (all-reduce SUM
   of each rank's counts over all its micro-batches);
2. pass them as ``global_tokens=`` and ``global_seqs=`` to every loss call (and the same
   ``norm_len`` everywhere for ``seq-mean-token-sum-norm``, e.g. the max response length, since the
   default ``T`` is the local padded length);
3. SUM the gradients over micro-batches (plain ``backward()`` accumulation) and over ranks (an
   all-reduce SUM, i.e. *not* the usual average: with an averaging reducer such as FSDP's or DDP's
   default, multiply the loss by the world size).

Then ``sum over pieces of loss(piece)`` equals ``loss(whole batch)`` exactly, for every mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlctl.algos.masked import masked_count, masked_mean, masked_sum, zero_masked
from rlctl.names import LossAgg, choices

__all__ = ["AGG_MODES", "PolicyLossContext", "aggregate", "gspo_policy_loss", "ppo_policy_loss", "value_loss"]

AGG_MODES = choices(LossAgg)
LOG_RATIO_CLAMP = 20.0

Count = int | float | Tensor


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: str,
    *,
    norm_len: int | None = None,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
) -> Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar; masked positions are ignored.

    - ``token-mean``: ``sum(L*m) / N_tokens``
    - ``seq-mean-token-sum``: ``sum_b sum_t(L*m) / N_seqs``
    - ``seq-mean-token-mean``: ``sum_b (sum_t(L*m) / sum_t(m)) / N_seqs``
    - ``seq-mean-token-sum-norm``: ``sum(L*m) / (N_seqs * norm_len)``, ``norm_len`` defaulting to ``T``

    ``N_tokens`` / ``N_seqs`` are the local ``sum(mask)`` / ``B`` unless ``global_tokens`` /
    ``global_seqs`` are given (see the module docstring for the data-parallel contract).
    """
    if mode == "token-mean":
        n_tokens = masked_count(mask) if global_tokens is None else global_tokens
        return masked_sum(loss, mask) / _at_least_one(n_tokens, loss)
    n_seqs = _at_least_one(loss.shape[0] if global_seqs is None else global_seqs, loss)
    if mode == "seq-mean-token-sum":
        return masked_sum(loss, mask) / n_seqs
    if mode == "seq-mean-token-mean":
        return masked_mean(loss, mask, dim=-1).sum() / n_seqs
    if mode == "seq-mean-token-sum-norm":
        length = loss.shape[-1] if norm_len is None else norm_len
        return masked_sum(loss, mask) / (n_seqs * length)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of: {', '.join(AGG_MODES)}")


def weigh(per_token: Tensor, is_weights: Tensor | None) -> Tensor:
    """The per-token loss times the rollout-correction weights (``is_weights``, detached; None: as is), before
    aggregation, as verl applies them (:mod:`rlctl.algos.correction`)."""
    return per_token if is_weights is None else per_token * is_weights.detach()


def reduce_policy_loss(
    per_token: Tensor,
    mask: Tensor,
    agg: str,
    norm_len: int | None,
    global_tokens: Count | None,
    global_seqs: Count | None,
    is_weights: Tensor | None,
) -> Tensor:
    """A policy loss's scalar: the per-token loss :func:`weigh`-ed by ``is_weights``, then :func:`aggregate`-d."""
    per_token = weigh(per_token, is_weights)
    return aggregate(per_token, mask, agg, norm_len=norm_len, global_tokens=global_tokens, global_seqs=global_seqs)


def token_inputs(advantages: Tensor, log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(advantages per token ``[B, T]``, log-ratio), both 0 on padding so that garbage there cannot reach the
    gradient (0 * nan = nan); ``advantages`` is ``[B, T]`` or ``[B]`` (one per sequence)."""
    adv = advantages if advantages.dim() == log_ratio.dim() else advantages.unsqueeze(-1)
    return zero_masked(adv, mask), zero_masked(log_ratio, mask)


def approx_kl(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """The metric ``approx_kl = mean(old_logp - logp)`` over the valid tokens (detached)."""
    return masked_mean(old_logp - logp, mask).detach()


def _at_least_one(count: Count, like: Tensor) -> Tensor:
    """A denominator as a float tensor on ``like``'s device, at least 1 (an empty batch gives 0,
    not nan); at least float32, since bfloat16 cannot hold token counts exactly."""
    dtype = torch.promote_types(like.dtype, torch.float32)
    return torch.as_tensor(count, dtype=dtype, device=like.device).clamp(min=1)


@dataclass(frozen=True)
class PolicyLossContext:
    """What every policy loss receives, one micro-batch's: ``fn(ctx) -> (loss, metrics)``.

    ``logp`` / ``old_logp`` / ``mask`` are ``[B, T]``; ``advantages`` ``[B, T]`` or ``[B]`` (one per
    sequence). The clip settings and ``agg`` are the resolved ones (the user's keys, else the loss's
    registered defaults); ``norm_len``, ``global_tokens`` and ``global_seqs`` the data-parallel denominators
    (module docstring); ``is_weights`` the rollout-correction weights (None: off); ``behav_logp`` the rollout
    engine's log-probs of the sampled tokens (the behaviour policy's; None where the caller has none). A loss's
    own knobs (``tau_pos``...) are its keyword arguments, with their defaults."""

    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    mask: Tensor
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: str = "token-mean"
    norm_len: int | None = None
    global_tokens: Count | None = None
    global_seqs: Count | None = None
    is_weights: Tensor | None = None
    behav_logp: Tensor | None = None

    def reduce(self, per_token: Tensor) -> Tensor:
        """The loss's scalar: ``per_token`` :func:`weigh`-ed by ``is_weights``, then :func:`aggregate`-d."""
        return reduce_policy_loss(
            per_token, self.mask, self.agg, self.norm_len, self.global_tokens, self.global_seqs, self.is_weights
        )

    def approx_kl(self) -> Tensor:
        return approx_kl(self.logp, self.old_logp, self.mask)

    def token_inputs(self) -> tuple[Tensor, Tensor]:
        """(per-token advantages, clamped log-ratio), both zero on padding."""
        log_ratio = (self.logp - self.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return token_inputs(self.advantages, log_ratio, self.mask)


def _clipped_surrogate(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO clip objective (with optional dual clip) and its clip fractions."""
    adv, log_ratio = token_inputs(advantages, log_ratio, mask)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": masked_mean((clipped > unclipped).float(), mask).detach()}
    if dual_clip is None:
        metrics["dual_clip_frac"] = torch.zeros((), device=loss.device)
        return loss, metrics
    if dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (got {dual_clip}); use None to disable it")
    bound = -adv * dual_clip
    use_bound = (adv < 0) & (bound < loss)
    loss = torch.where(use_bound, bound, loss)
    metrics["dual_clip_frac"] = masked_mean(use_bound.float(), mask).detach()
    return loss, metrics


def ppo_policy_loss(ctx: PolicyLossContext) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped policy loss with token-level ratios.

    ``ratio = exp(clamp(logp - old_logp, -20, 20))``; per token
    ``L = max(-A*ratio, -A*clamp(ratio, 1-clip_low, 1+clip_high))``; for ``A < 0`` the dual clip
    caps it at ``-A*dual_clip`` (``dual_clip`` > 1, ``None`` disables). ``advantages`` is ``[B, T]``
    or ``[B]`` (one per sequence); ``is_weights`` (rollout correction) multiply ``L`` before aggregation.
    Returns ``(aggregate(L), metrics)`` with metrics ``clip_frac``,
    ``dual_clip_frac`` and ``approx_kl = mean(old_logp - logp)`` over valid tokens.
    """
    log_ratio = (ctx.logp - ctx.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    per_token, metrics = _clipped_surrogate(
        log_ratio, ctx.advantages, ctx.mask, ctx.clip_low, ctx.clip_high, ctx.dual_clip
    )
    metrics["approx_kl"] = ctx.approx_kl()
    return ctx.reduce(per_token), metrics


def gspo_policy_loss(ctx: PolicyLossContext) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO policy loss: a clipped *sequence-level* ratio (Zheng et al. 2025, "GSPO-token" form).

    ``log s_b = mean_t(logp - old_logp)`` over valid tokens (clamped to +-20); each token uses
    ``s_bt = sg(s_b) * exp(logp_t - sg(logp_t))``, equal to ``s_b`` in value, whose gradient is
    ``s_b * grad logp_t``. Then the same clipped objective as :func:`ppo_policy_loss`, with the
    paper's small clip ranges and ``seq-mean-token-mean`` aggregation by default.
    """
    logp = ctx.logp
    seq_log_ratio = masked_mean(logp - ctx.old_logp, ctx.mask, dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logp - logp.detach()
    per_token, metrics = _clipped_surrogate(
        log_ratio, ctx.advantages, ctx.mask, ctx.clip_low, ctx.clip_high, ctx.dual_clip
    )
    metrics["approx_kl"] = ctx.approx_kl()
    return ctx.reduce(per_token), metrics


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    norm_len: int | None = None,
    global_tokens: Count | None = None,
    global_seqs: Count | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss ``0.5 * agg(max((V-R)^2, (clamp(V, V_old-clip, V_old+clip)-R)^2))``.

    ``clip=None`` gives the plain ``0.5 * agg((V-R)^2)``. Metric ``vf_clip_frac``: share of valid
    tokens where the clipped term is the larger one.
    """
    returns, old_values = zero_masked(returns, mask), zero_masked(old_values, mask)
    unclipped = (values - returns) ** 2
    if clip is None:
        per_token = unclipped
        clip_frac = torch.zeros((), device=values.device)
    else:
        clipped_v = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_v - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clip_frac = masked_mean((clipped > unclipped).float(), mask).detach()
    loss = 0.5 * aggregate(
        per_token, mask, agg, norm_len=norm_len, global_tokens=global_tokens, global_seqs=global_seqs
    )
    return loss, {"vf_clip_frac": clip_frac}
