"""The built-in advantage estimators in the registry's signature (:mod:`rlctl.algos.registry`), on the
global batch (rows ordered by uid, ``n`` consecutive rows per prompt)::

    estimator(rewards [B, T], mask [B, T], *, n, values [B, T] | None, gamma, lam, norm_by_std)
        -> (advantages [B, T], returns [B, T])
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlctl.algos.advantages import gae, grpo, reinforce_pp, rloo


def _outcome_scores(rewards: Tensor, mask: Tensor, n: int) -> tuple[Tensor, Tensor]:
    scores = (rewards * mask).sum(-1)
    return scores, torch.arange(scores.numel(), device=scores.device) // n


def grpo_advantages(rewards: Tensor, mask: Tensor, *, n: int, norm_by_std: bool = True, **_) -> tuple[Tensor, Tensor]:
    """GRPO: the sequence score against its group's mean (and std); broadcast over the tokens."""
    scores, groups = _outcome_scores(rewards, mask, n)
    adv = grpo(scores, groups, norm_by_std=norm_by_std)[:, None].to(mask.dtype) * mask
    return adv, adv


def rloo_advantages(rewards: Tensor, mask: Tensor, *, n: int, **_) -> tuple[Tensor, Tensor]:
    """RLOO: the sequence score minus the mean of the other samples of its prompt."""
    scores, groups = _outcome_scores(rewards, mask, n)
    adv = rloo(scores, groups)[:, None].to(mask.dtype) * mask
    return adv, adv


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, **_) -> tuple[Tensor, Tensor]:
    """REINFORCE++: discounted token returns, whitened over the batch."""
    adv = reinforce_pp(rewards, mask, gamma=gamma)
    return adv, adv


def gae_advantages(
    rewards: Tensor, mask: Tensor, *, values: Tensor | None, gamma: float = 1.0, lam: float = 1.0, **_
) -> tuple[Tensor, Tensor]:
    """GAE on the critic's values; returns = advantages + values (before whitening)."""
    if values is None:
        raise ValueError("gae needs the critic's values")
    return gae(rewards, values, mask, gamma=gamma, lam=lam)
