"""More of verl's policy losses, under verl's names (``algo.policy_loss``): cispo, gpg, geo_mean (GMPO),
clip_cov, kl_cov, sapo. Each takes one :class:`rlctl.algos.losses.PolicyLossContext`; every loss returns
the metrics ``clip_frac``, ``dual_clip_frac`` and ``approx_kl = mean(old_logp - logp)`` the trainer logs
(0 where the loss has no such notion). A loss's own knobs (``tau_pos``, ``clip_cov_ratio``...) are keyword
arguments with the paper's / verl's defaults. ``is_weights`` (rollout correction) multiply the per-token
loss before aggregation (geo_mean: their per-sequence geometric mean multiplies the sequence's).
Formulas and sources: docs/algos.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlctl.algos.losses import PolicyLossContext
from rlctl.algos.masked import masked_mean, zero_masked

__all__ = [
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "geo_mean_policy_loss",
    "gpg_policy_loss",
    "kl_cov_policy_loss",
    "sapo_policy_loss",
]


def _metrics(ctx: PolicyLossContext, clip_frac: Tensor | None = None) -> dict[str, Tensor]:
    zero = torch.zeros((), device=ctx.logp.device)
    return {
        "clip_frac": zero if clip_frac is None else clip_frac.detach(),
        "dual_clip_frac": zero,
        "approx_kl": ctx.approx_kl(),
    }


def cispo_policy_loss(ctx: PolicyLossContext) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2025): ``L = -sg(clamp(ratio, 1-clip_low, 1+clip_high)) * A * logp``: the clipped
    IS weight, stopped, on the REINFORCE term, so clipped tokens still get a gradient. ``clip_frac``: share of
    tokens whose ratio was clipped."""
    adv, log_ratio = ctx.token_inputs()
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - ctx.clip_low, 1.0 + ctx.clip_high)
    per_token = -clipped.detach() * adv * zero_masked(ctx.logp, ctx.mask)
    return ctx.reduce(per_token), _metrics(ctx, masked_mean((ratio != clipped).float(), ctx.mask))


def gpg_policy_loss(ctx: PolicyLossContext) -> tuple[Tensor, dict[str, Tensor]]:
    """GPG (Chu et al. 2025): ``L = -A * logp``, plain policy gradient, no ratio and no clip (the clip
    settings are ignored)."""
    adv, _ = ctx.token_inputs()
    per_token = -adv * zero_masked(ctx.logp, ctx.mask)
    return ctx.reduce(per_token), _metrics(ctx)


def geo_mean_policy_loss(ctx: PolicyLossContext) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673): the geometric mean of the token ratios, clipped in log
    space. With ``sgn = sign(A_t)``: ``l_t = sgn * min(sgn * lr_t, sgn * clamp(lr_t, -clip_low, clip_high))``,
    ``ratio_b = exp(mean_t l_t)``, ``A_b = mean_t A_t``, ``L_b = -A_b * ratio_b``; the loss is the mean over
    sequences (``sum_b L_b / N_seqs``, whatever ``agg`` says). ``clip_frac``: share of tokens whose log-ratio
    left the range."""
    adv, log_ratio = ctx.token_inputs()
    mask = ctx.mask
    sgn = torch.sign(adv)
    clamped = log_ratio.clamp(-ctx.clip_low, ctx.clip_high)
    kept = sgn * torch.minimum(sgn * log_ratio, sgn * clamped)
    ratio = torch.exp(masked_mean(kept, mask, dim=-1))
    per_seq = -masked_mean(adv, mask, dim=-1) * ratio
    if ctx.is_weights is not None:  # verl: the geometric mean of the token weights, per sequence
        per_seq = per_seq * torch.exp(masked_mean(torch.log(ctx.is_weights.detach() + 1e-10), mask, dim=-1))
    n_seqs = per_seq.shape[0] if ctx.global_seqs is None else ctx.global_seqs
    loss = per_seq.sum() / torch.as_tensor(n_seqs, dtype=per_seq.dtype, device=per_seq.device).clamp(min=1)
    return loss, _metrics(ctx, masked_mean((log_ratio != clamped).float(), mask))


def sapo_policy_loss(
    ctx: PolicyLossContext, *, tau_pos: float = 1.0, tau_neg: float = 1.05
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a soft gate in place of the hard clip,
    ``L = -A * sigmoid(tau (ratio - 1)) * 4 / tau`` with ``tau = tau_pos`` where ``A > 0``, else ``tau_neg``
    (the clip settings are ignored)."""
    adv, log_ratio = ctx.token_inputs()
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
    per_token = -torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv
    return ctx.reduce(per_token), _metrics(ctx)


def _centred_cov(adv: Tensor, logp: Tensor, valid: Tensor) -> Tensor:
    """Per token ``(A - mean A) * (logp - mean logp)``, means over the valid tokens (detached)."""
    lp = logp.detach()
    return (adv - masked_mean(adv, valid)) * (lp - masked_mean(lp, valid))


def clip_cov_policy_loss(
    ctx: PolicyLossContext,
    *,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): the PPO clip loss, with the gradient cut on
    ``max(1, int(clip_cov_ratio * N_tokens))`` tokens drawn at random among those the clip did not already
    clip whose covariance ``(A - mean A)(logp - mean logp)`` lies in ``(clip_cov_lb, clip_cov_ub)``.
    ``clip_frac``: share of tokens cut this way (verl's metric)."""
    adv, log_ratio = ctx.token_inputs()
    valid = ctx.mask.bool()
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - ctx.clip_low, 1.0 + ctx.clip_high)
    cov = _centred_cov(adv, ctx.logp, valid)
    candidate = valid & ~(clipped > unclipped) & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    idx = torch.nonzero(candidate)
    n_cut = max(int(clip_cov_ratio * int(valid.sum())), 1)
    perm = torch.randperm(len(idx), generator=generator)[:n_cut].to(idx.device)
    keep = torch.ones_like(adv)
    keep[idx[perm, 0], idx[perm, 1]] = 0.0
    per_token = torch.maximum(unclipped, clipped) * keep
    return ctx.reduce(per_token), _metrics(ctx, masked_mean((keep == 0).float(), ctx.mask))


def kl_cov_policy_loss(
    ctx: PolicyLossContext, *, kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al. 2025, arXiv 2505.22617): the unclipped ``-A * ratio`` on every token, plus
    ``ppo_kl_coef * |logp - old_logp|`` on the ``max(1, int(kl_cov_ratio * N_tokens))`` tokens with the
    largest covariance ``(A - mean A)(logp - mean logp)`` (the clip settings are ignored). ``clip_frac``:
    share of tokens penalised."""
    adv, log_ratio = ctx.token_inputs()
    valid = ctx.mask.bool()
    per_token = -adv * torch.exp(log_ratio)
    cov = _centred_cov(adv, ctx.logp, valid).masked_fill(~valid, -torch.inf).reshape(-1)
    k = max(1, int(int(valid.sum()) * kl_cov_ratio))
    penalised = torch.zeros_like(cov).scatter_(0, cov.topk(k).indices, 1.0).reshape(adv.shape)
    per_token = per_token + penalised * ppo_kl_coef * log_ratio.abs()
    return ctx.reduce(per_token), _metrics(ctx, masked_mean(penalised, ctx.mask))
