"""AReaL's decoupled PPO objective for trajectories whose tokens come from several policy versions.

Streaming RL (docs/async.md) samples a token with the behaviour policy ``pi_behav`` (the version that was
in the engine when it was sampled; its log-prob recorded per token), and trains it against a *proximal*
policy ``pi_prox``: the trainer's weights at the start of the update (its recomputed old log-probs). PPO's
clip then bounds the step from ``pi_prox``, not from the stale ``pi_behav``, and the off-policy gap is
an importance weight:

    loss_t = -(pi_prox_t / pi_behav_t) * min(r_t * A_t, clip(r_t, 1 - eps_low, 1 + eps_high) * A_t),
    r_t = pi_theta_t / pi_prox_t

with the behaviour weight detached and truncated at ``cap`` (AReaL's ``behav_imp_weight_cap``; tokens
whose weight exceeds it get weight 0, as AReaL masks them). With ``pi_prox = pi_behav`` (fresh samples) it
is PPO's clipped loss. The token-level alternative, the existing rollout correction
(:mod:`rlctl.algos.correction`), multiplies PPO's loss clipped against ``pi_behav`` by ``pi_theta / pi_behav``
weights instead.
"""

from __future__ import annotations

import torch
from torch import Tensor


def decoupled_ppo_loss(
    logp: Tensor,
    prox_logp: Tensor,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    cap: float | None = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The per-token losses (0 on padding) and metrics: ``behav_w_mean``, ``behav_w_masked`` (share of
    tokens above ``cap``), ``clipfrac``."""
    m = mask.to(logp.dtype)
    ratio = torch.exp(logp - prox_logp.detach())
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    w = torch.exp((prox_logp - behav_logp).detach().clamp(-20, 20))
    over = (w > cap) if cap is not None else torch.zeros_like(w, dtype=torch.bool)
    w = torch.where(over, torch.zeros_like(w), w)
    loss = -w * surrogate * m
    n = m.sum().clamp(min=1)
    metrics = {
        "behav_w_mean": (w * m).sum() / n,
        "behav_w_masked": (over.to(m.dtype) * m).sum() / n,
        "clipfrac": ((ratio != clipped).to(m.dtype) * m).sum() / n,
    }
    return loss, metrics
