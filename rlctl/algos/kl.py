"""KL penalty between the policy and the reference model, its coefficient controllers, entropy.

Per-token estimators of ``KL(pi || pi_ref)`` from sampled tokens, ``d = logp - ref_logp``
(Schulman, "Approximating KL divergence", 2020):

- ``k1`` (alias ``kl``): ``d``; unbiased, high variance, can be negative.
- ``abs``: ``|d|``.
- ``k2`` (alias ``mse``): ``0.5 * d^2``.
- ``k3`` (alias ``low_var_kl``): with ``x = clamp(ref_logp - logp, -20, 20)``,
  ``clamp(exp(x) - x - 1, -10, 10)``; unbiased, low variance, never negative.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlctl.names import KlKind, choices

__all__ = ["KL_KINDS", "AdaptiveKLController", "FixedKLController", "entropy_from_logits", "kl_estimate"]

KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
KL_KINDS = choices(KlKind)  # the canonical four and verl's aliases


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of the given ``kind`` (see the module docstring); same shape as ``logp``."""
    kind = KL_ALIASES.get(kind, kind)
    if kind == "k1":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if kind == "k3":
        x = (ref_logp - logp).clamp(-20.0, 20.0)
        return (torch.exp(x) - x - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of: {', '.join(KL_KINDS)}")


class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing."""

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient (same interface as :class:`AdaptiveKLController`)."""


class AdaptiveKLController:
    """KL coefficient steered toward a target KL (Ziegler et al. 2019).

    ``e = clamp(KL / target - 1, -0.2, 0.2)``; ``coef *= 1 + e * n_steps / horizon``, where
    ``n_steps`` is the number of samples (or steps) the measured ``current_kl`` covers.
    """

    def __init__(self, init_coef: float, target: float = 0.1, horizon: int = 10000) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0 (got {target}, {horizon})")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale the coefficient by ``1 + e * n_steps / horizon``."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``logsumexp(z) - sum(softmax(z) * z)``.

    Computed in float32 (or the input's precision if higher) on logits shifted by their max, so
    large logits lose no precision.
    """
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    z = z - z.amax(dim=-1, keepdim=True).detach()
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)
