"""AReaL's decoupled PPO objective for trajectories whose tokens come from several policy versions.

Streaming RL (docs/async.md) samples a token with the behaviour policy ``pi_behav`` (the version that was
in the engine when it was sampled; its log-prob recorded per token), and trains it against a *proximal*
policy ``pi_prox``: the trainer's weights at the start of the update (its recomputed old log-probs, or the
update's own first forward when the batch gets one optimizer step). PPO's clip then bounds the step from
``pi_prox``, not from the stale ``pi_behav``, and the off-policy gap is an importance weight:

    loss_t = (pi_prox_t / pi_behav_t) * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),
    r_t = pi_theta_t / pi_prox_t

(with the dual clip ``min(., c A_t)`` for ``A_t < 0`` when set, AReaL's ``c_clip``), the behaviour weight
detached, and tokens whose weight exceeds ``cap`` dropped (weight 0: AReaL's ``behav_imp_weight_cap``, which
filters, not truncates). With ``pi_prox = pi_behav`` (fresh samples) it is PPO's clipped loss.

As ``algo.policy_loss=decoupled`` (:func:`decoupled_policy_loss`, ``--policy-loss decoupled``) the weight
is ``exp(old_logp - rollout_logp)``: the trainer's pre-update log-probs over the rollout engine's. That is
the ratio the rollout correction (:mod:`rlctl.algos.correction`, token level) weighs by too, so the two are
never on together: with this loss the correction's default is off and an explicit one is refused
(``rlctl.support.behaviour_weighed_twice``). The difference from ``ppo`` + token TIS: tokens above the cap
get 0, not the cap, and the default dual clip is off (AReaL's defaults).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlctl.algos.losses import LOG_RATIO_CLAMP, PolicyLossContext, _clipped_surrogate
from rlctl.algos.masked import masked_mean

__all__ = ["DEFAULT_CAP", "behaviour_weights", "decoupled_policy_loss", "decoupled_ppo_loss"]

DEFAULT_CAP = 5.0  # AReaL's examples' behav_imp_weight_cap


def behaviour_weights(prox_logp: Tensor, behav_logp: Tensor, mask: Tensor, cap: float | None) -> tuple[Tensor, Tensor]:
    """(``w``: ``pi_prox / pi_behav`` per token, detached, 0 on padding and above ``cap``; ``over``: the tokens
    above ``cap``)."""
    valid = mask.bool()
    log_w = torch.where(valid, (prox_logp - behav_logp).detach(), prox_logp.new_zeros(()))
    w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    over = valid & (w > cap) if cap is not None else torch.zeros_like(valid)
    return torch.where(over | ~valid, torch.zeros_like(w), w), over


def _metrics(w: Tensor, over: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``behav_w_mean`` (over the response tokens, dropped ones as 0) and ``behav_w_masked`` (share dropped)."""
    return {"behav_w_mean": masked_mean(w, mask).detach(), "behav_w_masked": masked_mean(over.float(), mask).detach()}


def decoupled_policy_loss(
    ctx: PolicyLossContext, *, cap: float | None = DEFAULT_CAP
) -> tuple[Tensor, dict[str, Tensor]]:
    """The registered ``decoupled`` policy loss: ``old_logp`` is the proximal policy, ``behav_logp`` the
    behaviour one (module doc); aggregated by ``ctx.agg`` with the run's denominators. Metrics: ``clip_frac``,
    ``dual_clip_frac``, ``approx_kl`` (against the proximal policy), ``behav_w_mean``, ``behav_w_masked``."""
    if ctx.behav_logp is None:
        raise ValueError("the decoupled policy loss needs the rollout engine's log-probs: PolicyLossContext.behav_logp")
    log_ratio = (ctx.logp - ctx.old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    per_token, metrics = _clipped_surrogate(
        log_ratio, ctx.advantages, ctx.mask, ctx.clip_low, ctx.clip_high, ctx.dual_clip
    )
    w, over = behaviour_weights(ctx.old_logp, ctx.behav_logp, ctx.mask, cap)
    metrics |= {"approx_kl": ctx.approx_kl(), **_metrics(w, over, ctx.mask)}
    return ctx.reduce(per_token * w), metrics


def decoupled_ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    cap: float | None = DEFAULT_CAP,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token losses (0 on padding; no dual clip, no aggregation: benchmarks/async_vs_sync.py's own
    trainer reduces them) and the metrics of :func:`decoupled_policy_loss`."""
    log_ratio = (logp - prox_logp.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    per_token, metrics = _clipped_surrogate(log_ratio, advantages, mask, clip_low, clip_high, None)
    w, over = behaviour_weights(prox_logp, behav_logp, mask, cap)
    return per_token * w * mask.to(per_token.dtype), {**metrics, **_metrics(w, over, mask)}
