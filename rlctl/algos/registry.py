"""Advantage estimators and policy losses registered by name (as verl's ``register_adv_est`` /
``register_policy_loss``): the config names one (``algo.adv``, ``algo.policy_loss``) and the recipe
looks it up; no recipe branches on the algorithm.

A policy loss carries its OWN defaults (clip range, dual clip, loss aggregation): PPO clips at
0.2/0.2 with a dual clip of 3 and averages over tokens; GSPO clips its sequence ratio at 3e-4/4e-4
with no dual clip and aggregates seq-mean-token-mean (Zheng et al. 2025). A config key the user set
(not None) wins over the loss's default: :func:`resolve_policy_loss`.

Every advantage estimator has one signature, on the global batch (rows ordered by uid, ``n``
consecutive rows per prompt)::

    estimator(rewards [B, T], mask [B, T], *, n, values [B, T] | None, gamma, lam, norm_by_std)
        -> (advantages [B, T], returns [B, T])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlctl.algos.advantages import gae, grpo, reinforce_pp, rloo
from rlctl.algos.losses import gspo_policy_loss, ppo_policy_loss
from rlctl.errors import UserError, did_you_mean


@dataclass(frozen=True)
class AdvEstimator:
    name: str
    fn: Callable[..., tuple[Tensor, Tensor]]
    needs_critic: bool  # GAE: values from a critic (rlctl ppo)
    needs_groups: bool  # compares the samples of one prompt: rollout.n >= 2


@dataclass(frozen=True)
class PolicyLoss:
    name: str
    fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]
    clip_low: float
    clip_high: float
    dual_clip: float | None
    agg: str


@dataclass(frozen=True)
class PolicyLossSettings:
    """What reaches the loss after the user's keys and the loss's defaults are merged."""

    loss: PolicyLoss
    clip_low: float
    clip_high: float
    dual_clip: float | None  # None: off
    agg: str

    def as_metrics(self) -> dict[str, float | str]:
        return {
            "policy_loss": self.loss.name,
            "clip_low": self.clip_low,
            "clip_high": self.clip_high,
            "dual_clip": self.dual_clip or 0.0,
            "loss_agg": self.agg,
        }


ADV_ESTIMATORS: dict[str, AdvEstimator] = {}
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_adv_est(name: str, *, needs_critic: bool = False, needs_groups: bool = False):
    """Decorator: register an advantage estimator under ``name`` (the value of ``algo.adv``)."""

    def wrap(fn):
        ADV_ESTIMATORS[name] = AdvEstimator(name, fn, needs_critic, needs_groups)
        return fn

    return wrap


def register_policy_loss(
    name: str, *, clip_low: float, clip_high: float, dual_clip: float | None, agg: str
) -> Callable:
    """Decorator: register ``fn(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip, agg,
    norm_len, global_tokens, global_seqs) -> (loss, metrics)`` under ``name`` with its defaults."""

    def wrap(fn):
        POLICY_LOSSES[name] = PolicyLoss(name, fn, clip_low, clip_high, dual_clip, agg)
        return fn

    return wrap


def get_adv_estimator(name: str) -> AdvEstimator:
    if name not in ADV_ESTIMATORS:
        raise UserError(
            f"unknown advantage estimator algo.adv={name!r}{did_you_mean(name, ADV_ESTIMATORS)}; "
            f"choose one of {', '.join(ADV_ESTIMATORS)}"
        )
    return ADV_ESTIMATORS[name]


def get_policy_loss(name: str) -> PolicyLoss:
    if name not in POLICY_LOSSES:
        raise UserError(
            f"unknown policy loss algo.policy_loss={name!r}{did_you_mean(name, POLICY_LOSSES)}; "
            f"choose one of {', '.join(POLICY_LOSSES)}"
        )
    return POLICY_LOSSES[name]


def resolve_policy_loss(
    name: str, *, clip_low: float | None, clip_high: float | None, dual_clip: float | None, agg: str | None
) -> PolicyLossSettings:
    """The loss ``name`` with the user's settings where given (not None) and its own defaults elsewhere.
    ``dual_clip=0`` (set by the user) turns the dual clip off."""
    loss = get_policy_loss(name)
    return PolicyLossSettings(
        loss,
        loss.clip_low if clip_low is None else clip_low,
        loss.clip_high if clip_high is None else clip_high,
        (loss.dual_clip if dual_clip is None else dual_clip) or None,
        loss.agg if agg is None else agg,
    )


# ---------------------------------------------------------------------------------------------
# The built-in policy losses

register_policy_loss("ppo", clip_low=0.2, clip_high=0.2, dual_clip=3.0, agg="token-mean")(ppo_policy_loss)
register_policy_loss("gspo", clip_low=3e-4, clip_high=4e-4, dual_clip=None, agg="seq-mean-token-mean")(gspo_policy_loss)


# ---------------------------------------------------------------------------------------------
# The built-in advantage estimators


def _outcome_scores(rewards: Tensor, mask: Tensor, n: int) -> tuple[Tensor, Tensor]:
    scores = (rewards * mask).sum(-1)
    return scores, torch.arange(scores.numel(), device=scores.device) // n


@register_adv_est("grpo", needs_groups=True)
def grpo_advantages(rewards: Tensor, mask: Tensor, *, n: int, norm_by_std: bool = True, **_) -> tuple[Tensor, Tensor]:
    """GRPO: the sequence score against its group's mean (and std); broadcast over the tokens."""
    scores, groups = _outcome_scores(rewards, mask, n)
    adv = grpo(scores, groups, norm_by_std=norm_by_std)[:, None].to(mask.dtype) * mask
    return adv, adv


@register_adv_est("rloo", needs_groups=True)
def rloo_advantages(rewards: Tensor, mask: Tensor, *, n: int, **_) -> tuple[Tensor, Tensor]:
    """RLOO: the sequence score minus the mean of the other samples of its prompt."""
    scores, groups = _outcome_scores(rewards, mask, n)
    adv = rloo(scores, groups)[:, None].to(mask.dtype) * mask
    return adv, adv


@register_adv_est("reinforce_pp")
def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, **_) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted token returns, whitened over the batch."""
    adv = reinforce_pp(rewards, mask, gamma=gamma)
    return adv, adv


@register_adv_est("gae", needs_critic=True)
def gae_advantages(
    rewards: Tensor, mask: Tensor, *, values: Tensor | None, gamma: float = 1.0, lam: float = 1.0, **_
) -> tuple[Tensor, Tensor]:
    """GAE on the critic's values; returns = advantages + values (before whitening)."""
    if values is None:
        raise ValueError("gae needs the critic's values")
    return gae(rewards, values, mask, gamma=gamma, lam=lam)
