"""Masked reductions over response tokens.

A mask is 1 on the tokens that count (response tokens) and 0 on padding; it may be bool, int or
float. Masked positions never influence a result, even when they hold garbage (inf, nan), because
they are selected away with ``torch.where`` rather than multiplied by zero.
"""

from __future__ import annotations

import torch
from torch import Tensor


def zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with masked positions set to 0 (whatever they held, nan and inf included)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over the positions where ``mask`` is set (all dims, or along ``dim``)."""
    kept = zero_masked(x, mask)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """Number of set positions of ``mask`` as a float tensor (all dims, or along ``dim``)."""
    m = mask.bool().float()
    return m.sum() if dim is None else m.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the valid positions; 0 where there is none."""
    count = masked_count(mask, dim).to(x.dtype)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, *, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all valid positions (Bessel-corrected by default).

    With fewer than two valid positions the variance is 0 (there is nothing to correct).
    """
    mean = masked_mean(x, mask)
    sq = masked_sum((x - mean) ** 2, mask)
    n = masked_count(mask).to(x.dtype)
    denom = (n - 1).clamp(min=1) if unbiased else n.clamp(min=1)
    return sq / denom


def masked_whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) * rsqrt(var + eps)`` with the masked mean and unbiased variance.

    With ``shift_mean=False`` the mean is added back (only the scale changes). Masked positions of
    the result are 0.
    """
    mean = masked_mean(x, mask)
    white = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        white = white + mean
    return zero_masked(white, mask)
