"""The built-in advantage estimators in the registry's signature (:mod:`rlctl.algos.registry`), on the
global batch (rows ordered by uid, ``n`` consecutive rows per prompt)::

    estimator(rewards [B, T], mask [B, T], *, n, values [B, T] | None, gamma, lam, norm_by_std)
        -> (advantages [B, T], returns [B, T])
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlctl.algos.advantages import gae, grpo, reinforce_pp, rloo
from rlctl.algos.masked import masked_whiten


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


# ---------------------------------------------------------------------------------------------
# More of verl's estimators, under verl's names (outcome rewards; rows grouped n per prompt)


def _groups(rewards: Tensor, mask: Tensor, n: int) -> Tensor:
    """The sequence scores as a ``[G, n]`` matrix (float, at least float32)."""
    scores = (rewards * mask).sum(-1)
    return scores.to(torch.promote_types(scores.dtype, torch.float32)).reshape(-1, n)


def _broadcast(per_seq: Tensor, mask: Tensor) -> Tensor:
    """One value per row on every token of the row; the mask's dtype when it is floating."""
    dtype = mask.dtype if mask.dtype.is_floating_point else per_seq.dtype
    return per_seq.reshape(-1)[:, None].to(dtype) * mask.to(dtype)


@torch.no_grad()
def grpo_passk_advantages(
    rewards: Tensor, mask: Tensor, *, n: int, norm_by_std: bool = True, eps: float = 1e-6, **_
) -> tuple[Tensor, Tensor]:
    """Pass@k (Chen et al. 2025, arXiv 2503.19595): only the best sample of a group gets a non-zero
    advantage, ``r_max - r_second_max`` (divided by ``std_g + eps``, unbiased, when ``norm_by_std``)."""
    s = _groups(rewards, mask, n)
    top = s.topk(2, dim=-1).values
    gap = top[:, 0] - top[:, 1]
    if norm_by_std:
        gap = gap / (s.std(dim=-1) + eps)
    best = s.argmax(dim=-1)  # the first of tied maxima
    adv = torch.zeros_like(s).scatter_(1, best[:, None], gap[:, None])
    out = _broadcast(adv, mask)
    return out, out


@torch.no_grad()
def reinforce_pp_baseline_advantages(rewards: Tensor, mask: Tensor, *, n: int, **_) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (Hu 2025): ``s - mean_g`` on every token, then whitened over the batch's
    valid tokens."""
    s = _groups(rewards, mask, n)
    centred = _broadcast(s - s.mean(dim=-1, keepdim=True), mask)
    out = masked_whiten(centred, mask)
    return out, out


@torch.no_grad()
def opo_advantages(rewards: Tensor, mask: Tensor, *, n: int, **_) -> tuple[Tensor, Tensor]:
    """OPO (Hao et al. 2025, arXiv 2505.23585): the length-weighted group baseline
    ``b_g = sum_i |o_i| s_i / sum_i |o_i|``; ``A = s - b_g``."""
    s = _groups(rewards, mask, n)
    lengths = mask.sum(-1).to(s.dtype).reshape(-1, n)
    baseline = (lengths * s).sum(-1, keepdim=True) / lengths.sum(-1, keepdim=True).clamp(min=1)
    out = _broadcast(s - baseline, mask)
    return out, out


@torch.no_grad()
def gpg_advantages(rewards: Tensor, mask: Tensor, *, n: int, f_norm: float = 1.0, **_) -> tuple[Tensor, Tensor]:
    """GPG (Chu et al. 2025, arXiv 2504.02546): ``A = alpha (s - mean_g) / f_norm`` with
    ``alpha = B / (number of non-zero scores in the batch)`` (at least one), ``f_norm = 1``."""
    s = _groups(rewards, mask, n)
    alpha = s.numel() / torch.count_nonzero(s).clamp(min=1)
    out = _broadcast(alpha * (s - s.mean(dim=-1, keepdim=True)) / f_norm, mask)
    return out, out


@torch.no_grad()
def remax_advantages(
    rewards: Tensor, mask: Tensor, *, reward_baselines: Tensor | None = None, **_
) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv 2310.10505): ``returns_t = sum_{t' >= t} r_t'`` and
    ``A_t = returns_t - b``, where ``b`` is the reward of the prompt's greedy response (one per row)."""
    if reward_baselines is None:
        raise ValueError("remax needs reward_baselines: the reward of each prompt's greedy (argmax) response")
    r = rewards * mask
    returns = r.flip(-1).cumsum(-1).flip(-1)
    adv = returns - reward_baselines.reshape(-1, 1).to(returns.dtype) * mask
    return adv, returns
