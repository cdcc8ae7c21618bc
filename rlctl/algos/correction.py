"""Rollout-mismatch correction: importance weights trainer / rollout (verl's rollout correction).

The rollout engine samples from ``pi_rollout`` (its kernels, dtype, batching); the trainer computes
``pi_train`` on the same tokens. With ``log_ratio = log pi_train - log pi_rollout`` per response token:

- ``level="token"``: ``w_t = exp(clamp(log_ratio_t, -20, 20))``;
  ``level="sequence"``: ``w = exp(clamp(sum_t m_t * log_ratio_t, -20, 20))`` on every token of the
  sequence. Padding gets weight 0.
- ``mode="tis"`` (truncated IS): ``w = min(w, U)``; ``mode="mis"`` (masked IS, IcePop): ``w`` kept where
  ``L <= w <= U``, else 0. ``threshold`` is ``U`` (then ``L = 1/U``; also as a string, ``"2.0"``) or the
  string ``"L_U"``. Without a mode, the threshold's form chooses as verl's ``rollout_is_threshold`` does:
  ``U`` truncates (tis), ``"L_U"`` masks (mis).
- ``reject`` (optional, ``R`` or ``"L_U"``): whole sequences whose geometric-mean ratio
  ``exp(mean_t log_ratio_t)`` falls outside ``[L, U]`` get weight 0 (verl's ``rollout_rs="geometric"``).

The weights are detached: they change the measure, not the objective, and multiply the per-token
policy loss before aggregation. Metrics (0-d tensors, over valid tokens; verl's definitions) are taken
on the weights before truncation / masking: ``is_mean/max/min/std``, ``is_ess`` (the normalised
effective sample size ``1 / mean((w/mean w)^2)`` of the weights clamped to ``[L, U]``),
``is_frac_high/low`` (share above ``U`` / below ``L``), ``is_frac_truncated`` (tis) or
``is_frac_masked`` (mis), ``is_seq_rejected`` and the mismatch KL(rollout || train) as ``mismatch_kl_k1``
(``mean(-log_ratio)``) and ``mismatch_kl_k3`` (``mean(exp(log_ratio) - log_ratio - 1)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlctl.algos.masked import masked_mean, masked_sum
from rlctl.names import CorrectionLevel, CorrectionMode, choices

__all__ = ["SAFETY_BOUND", "Correction", "correction_for", "default_mode", "is_bounds", "is_weights", "parse_threshold"]

SAFETY_BOUND = 20.0


def is_bounds(threshold: float | str) -> bool:
    """Is ``threshold`` verl's ``"L_U"`` form (two bounds), not one upper bound (``2.0`` or ``"2.0"``)?"""
    return isinstance(threshold, str) and "_" in threshold


def default_mode(threshold: float | str) -> str:
    """The mode verl reads from a threshold's form: ``"L_U"`` masks (mis, IcePop), ``U`` truncates (tis)."""
    return "mis" if is_bounds(threshold) else "tis"


def parse_threshold(threshold: float | str) -> tuple[float, float]:
    """``2.0`` or ``"2.0"`` -> ``(0.5, 2.0)``; ``"0.5_5"`` -> ``(0.5, 5.0)``. Raises ValueError on a bad value."""
    if isinstance(threshold, str) and not is_bounds(threshold):
        try:
            threshold = float(threshold)
        except ValueError:
            raise ValueError(f"threshold {threshold!r}: write a number U >= 1 or 'LOWER_UPPER', e.g. '0.5_2'") from None
    if isinstance(threshold, str):
        low_s, sep, high_s = threshold.partition("_")
        try:
            low, high = float(low_s), float(high_s)
        except ValueError:
            low = high = float("nan")
        if not sep or not (0 < low <= 1 <= high) or math.isinf(high):
            raise ValueError(f"threshold {threshold!r}: write 'LOWER_UPPER' with 0 < LOWER <= 1 <= UPPER, e.g. '0.5_2'")
        return low, high
    high = float(threshold)
    if not high >= 1 or math.isinf(high):
        raise ValueError(f"threshold {threshold!r}: the upper bound must be a finite number >= 1, e.g. 2.0")
    return 1.0 / high, high


def _raw_weights(log_ratio: Tensor, valid: Tensor, level: str) -> tuple[Tensor, Tensor]:
    """(weights [B, T] zero on padding, unclamped log-ratio per unit: [B, T] tokens or [B] sequences)."""
    if level == "token":
        unit_log = log_ratio
        w = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        unit_log = masked_sum(log_ratio, valid, dim=-1)
        w = torch.exp(unit_log.clamp(-SAFETY_BOUND, SAFETY_BOUND)).unsqueeze(-1).expand_as(log_ratio)
    else:
        raise ValueError(f"unknown correction level {level!r}; choose one of {', '.join(choices(CorrectionLevel))}")
    return torch.where(valid, w, torch.zeros_like(w)), unit_log


def _weight_metrics(
    w: Tensor, unit_log: Tensor, valid: Tensor, level: str, low: float, high: float
) -> dict[str, Tensor]:
    """verl's IS statistics of the raw weights ``w`` (before truncation / masking)."""
    m: dict[str, Tensor] = {"is_mean": masked_mean(w, valid)}
    if level == "sequence":  # in log space, so the true extremes show past the safety bound
        has = valid.any(-1)
        logs = unit_log[has]
        m["is_max"] = torch.exp(logs.max().clamp(max=SAFETY_BOUND))
        m["is_min"] = torch.exp(logs.min())
        m["is_frac_high"] = (logs > math.log(high)).float().mean()
        m["is_frac_low"] = (logs < math.log(low)).float().mean()
    else:
        m["is_max"] = w.masked_fill(~valid, -math.inf).max()
        m["is_min"] = w.masked_fill(~valid, math.inf).min()
        m["is_frac_high"] = masked_mean((w > high).float(), valid)
        m["is_frac_low"] = masked_mean((w < low).float(), valid)
    wc = w.clamp(low, high)
    mean_c = masked_mean(wc, valid)
    var = masked_mean(wc.square(), valid) - mean_c.square()
    m["is_std"] = var.clamp(min=0).sqrt() if valid.sum() > 1 else torch.zeros_like(mean_c)
    m["is_ess"] = 1.0 / masked_mean((wc / (mean_c + 1e-8)).square(), valid)
    return m


@torch.no_grad()
def is_weights(
    log_ratio: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    threshold: float | str = 2.0,
    mode: str | None = None,
    reject: float | str | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights ``[B, T]`` (detached, 0 on padding) and their metrics; see the module doc.

    ``log_ratio = log pi_train - log pi_rollout`` ``[B, T]``; ``mask`` 1 on response tokens. ``mode``
    None: from the threshold's form (:func:`default_mode`), as verl reads ``rollout_is_threshold``.
    """
    mode = default_mode(threshold) if mode is None else mode
    if mode not in choices(CorrectionMode, without=("none",)):
        raise ValueError(f"unknown correction mode {mode!r}; choose tis or mis")
    valid = mask.bool()
    if not valid.any():
        raise ValueError("is_weights: the mask has no valid token")
    dtype = torch.promote_types(log_ratio.dtype, torch.float32)
    log_ratio = torch.where(valid, log_ratio.detach().to(dtype), torch.zeros((), dtype=dtype, device=valid.device))
    low, high = parse_threshold(threshold)
    w, unit_log = _raw_weights(log_ratio, valid, level)
    metrics = _weight_metrics(w, unit_log, valid, level, low, high)
    if mode == "tis":
        metrics["is_frac_truncated"] = masked_mean((w > high).float(), valid)
        w = w.clamp(max=high)
    else:
        inside = (w >= low) & (w <= high)
        metrics["is_frac_masked"] = masked_mean((~inside).float(), valid)
        w = torch.where(inside, w, torch.zeros_like(w))
    metrics["is_seq_rejected"] = torch.zeros(())
    if reject is not None:
        r_low, r_high = parse_threshold(reject)
        geo = masked_mean(log_ratio, valid, dim=-1)
        keep = (geo >= math.log(r_low)) & (geo <= math.log(r_high))
        metrics["is_seq_rejected"] = (~keep)[valid.any(-1)].float().mean()
        w = w * keep.unsqueeze(-1)
    metrics["mismatch_kl_k1"] = masked_mean(-log_ratio, valid)
    metrics["mismatch_kl_k3"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, valid)
    return w, metrics


@dataclass(frozen=True)
class Correction:
    """The resolved ``algo.rollout_correction`` settings of a run (mode tis | mis)."""

    mode: str
    level: str
    threshold: float | str  # U, or "L_U"
    reject: float | None

    def weights(self, log_ratio: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return is_weights(
            log_ratio, mask, level=self.level, threshold=self.threshold, mode=self.mode, reject=self.reject
        )


def correction_for(
    mode: str | None,
    engine: str,
    *,
    level: str,
    upper: float,
    lower: float | None,
    reject: float | None,
    off_policy: bool = False,
    loss_weighs_behaviour: bool = False,
) -> Correction | None:
    """``mode`` None: none when the policy loss weighs tokens by proximal / behaviour itself
    (``loss_weighs_behaviour``: decoupled PPO), else tis when the rollout ``engine`` is not the trainer's own
    forward (vllm, sglang) or the batches are ``off_policy`` (generated by older weights), else none. Returns
    None for none."""
    if mode is None:
        mode = "tis" if (engine in ("vllm", "sglang") or off_policy) and not loss_weighs_behaviour else "none"
    if mode == "none":
        return None
    threshold: float | str = upper if lower is None else f"{lower}_{upper}"
    parse_threshold(threshold)
    return Correction(mode, level, threshold, reject)
