"""Advantage estimators: GRPO, RLOO, REINFORCE++ and GAE.

Shapes: ``B`` sequences, ``T`` response tokens, ``mask[b, t]`` = 1 on response tokens. The
outcome estimators (:func:`grpo`, :func:`rloo`) take one score per sequence and return one
advantage per sequence; broadcast it over the tokens (``adv[:, None] * mask``) or hand it to the
policy losses as is. Advantages are constants: every estimator runs under ``torch.no_grad()``.
Formulas and references: ``docs/algos.md``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from rlctl.algos.masked import masked_mean, masked_var, masked_whiten

__all__ = ["gae", "grpo", "masked_mean", "masked_var", "masked_whiten", "reinforce_pp", "rloo"]

GroupIds = Tensor | Sequence[Hashable]


def _float(x: Tensor) -> Tensor:
    """``x`` as a floating tensor of at least float32 precision."""
    x = torch.as_tensor(x)
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _group_index(group_ids: GroupIds, n: int, device: torch.device) -> tuple[Tensor, int]:
    """Map group ids (tensor, or list of ints / strings) to dense indices 0..G-1."""
    if isinstance(group_ids, Tensor):
        if group_ids.numel() != n:
            raise ValueError(f"group_ids has {group_ids.numel()} entries for {n} scores")
        uniq, index = torch.unique(group_ids.reshape(-1).to(device), return_inverse=True)
        return index, uniq.numel()
    ids = list(group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids has {len(ids)} entries for {n} scores")
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in ids]
    return torch.tensor(index, dtype=torch.long, device=device), len(dense)


def _group_stats(scores: Tensor, group_ids: GroupIds) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for a group of one)."""
    index, n_groups = _group_index(group_ids, scores.numel(), scores.device)
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, index, torch.ones_like(scores))
    mean = zeros.index_add(0, index, scores) / count
    centered_sq = (scores - mean[index]) ** 2
    var = zeros.index_add(0, index, centered_sq) / (count - 1).clamp(min=1)
    return count[index], mean[index], var.sqrt()[index]


@torch.no_grad()
def grpo(scores: Tensor, group_ids: GroupIds, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantage per sequence: ``(s - mean_g) / (std_g + eps)``.

    ``std_g`` is the unbiased (Bessel) std of the group. ``norm_by_std=False`` gives
    ``s - mean_g`` (Dr. GRPO). A group of one has no baseline and gets advantage 0.
    """
    s = _float(scores).reshape(-1)
    count, mean, std = _group_stats(s, group_ids)
    adv = s - mean
    if norm_by_std:
        adv = adv / (std + eps)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


@torch.no_grad()
def rloo(scores: Tensor, group_ids: GroupIds) -> Tensor:
    """RLOO advantage: ``s - mean of the other samples of the group = n/(n-1) * (s - mean_g)``.

    A group of one gets advantage 0.
    """
    s = _float(scores).reshape(-1)
    count, mean, _ = _group_stats(s, group_ids)
    adv = count / (count - 1).clamp(min=1) * (s - mean)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


@torch.no_grad()
def reinforce_pp(rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ advantages ``[B, T]``.

    Per-token discounted return ``G_t = r_t + gamma * G_{t+1}`` computed right to left within each
    sequence (starting from 0 after its last token; masked positions are skipped and their
    rewards ignored), then whitened over all valid tokens of the batch. Masked positions are 0.
    """
    r = _float(rewards)
    valid = mask.bool()
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(valid[:, t], r[:, t] + gamma * running, running)
        returns[:, t] = running
    return masked_whiten(returns, valid)


@torch.no_grad()
def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; returns ``(advantages, returns)``, both ``[B, T]``.

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, right to
    left, where "next" is the next *valid* token of the sequence (0 past the last one).
    ``returns = A + V`` before whitening; the advantages are then whitened over valid tokens.
    Masked positions of both outputs are 0.
    """
    r, v = _float(rewards), _float(values)
    valid = mask.bool()
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lam * next_adv
        m = valid[:, t]
        adv[:, t] = torch.where(m, a_t, torch.zeros_like(a_t))
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, a_t, next_adv)
    zero = torch.zeros((), dtype=adv.dtype, device=adv.device)
    returns = torch.where(valid, adv + v, zero)
    return masked_whiten(adv, valid), returns
