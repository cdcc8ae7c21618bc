"""The DPO family's losses (:mod:`rlctl.algos.preference` registers them by name), per pair.

Inputs are sequence log-probs: the SUM over a response's tokens of the token log-probs (prompt tokens
excluded), with the response lengths for the losses that average per token (IPO as TRL computes it,
SimPO, ORPO). With ``h = (pi_c - ref_c) - (pi_r - ref_r)`` (``pi``/``ref``: the policy's and the
reference's log-probs, ``c``/``r``: chosen and rejected), and ``e`` the label smoothing:

- sigmoid (DPO): ``-(1 - e) log s(beta h) - e log s(-beta h)`` (cDPO's smoothing; TRL 1.16's sigmoid has none:
  ``e = 0``, the default, is TRL's loss)
- robust: ``(-(1 - e) log s(beta h) + e log s(-beta h)) / (1 - 2e)``
- hinge (SLiC): ``relu(1 - beta h)``
- ipo: ``(h' - 1 / (2 beta))^2``, h' from per-token MEAN log-probs (TRL's convention)
- simpo: ``-(1 - e) log s(beta (m_c - m_r) - gamma) - e log s(-(...))``, m: per-token mean policy log-probs
- orpo: ``-beta log s(log odds(c) - log odds(r))`` with ``odds = P / (1 - P)``, ``P = exp(m)``; the recipe
  adds the chosen responses' NLL (the registry's ``nll``)
- kto (unpaired): ``1 - s(beta (r - z0))`` for a good row, ``1 - s(beta (z0 - r))`` for a bad one, with
  ``r = pi - ref`` and ``z0`` the batch's detached KL estimate (``PrefInputs.kl``), weighted per class

Each returns ``(losses [P], chosen_rewards [P], rejected_rewards [P])``; the rewards are what TRL logs
as rewards/chosen and rewards/rejected (detached). For KTO a row is "chosen" when its label is good:
its rewards are ``beta r`` on its own class's side and NaN on the other (the recipe averages each side
over its rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class PrefInputs:
    """Sequence log-probs of a batch of pairs ``[P]`` (KTO: of rows, with ``chosen_*`` holding every row)."""

    chosen_logps: Tensor  # the policy's summed log-probs of the chosen responses
    rejected_logps: Tensor
    chosen_len: Tensor  # response tokens (float)
    rejected_len: Tensor
    ref_chosen_logps: Tensor | None = None  # the reference's (None for a loss without one)
    ref_rejected_logps: Tensor | None = None
    label: Tensor | None = None  # KTO: True for a desirable row
    kl: Tensor | None = None  # KTO: z0, the detached KL estimate (a 0-d tensor >= 0)
    desirable_weight: float = 1.0  # KTO's lambda_D and lambda_U
    undesirable_weight: float = 1.0


def _smoothed(x: Tensor, e: float) -> Tensor:
    """``-(1 - e) log s(x) - e log s(-x)``: DPO's sigmoid loss with conservative label smoothing."""
    return -(1 - e) * F.logsigmoid(x) - e * F.logsigmoid(-x)


def _ref_rewards(b: PrefInputs, beta: float) -> tuple[Tensor, Tensor, Tensor]:
    """(h, beta (pi_c - ref_c), beta (pi_r - ref_r)): DPO's log-ratio margin and its implicit rewards."""
    chosen = b.chosen_logps - b.ref_chosen_logps
    rejected = b.rejected_logps - b.ref_rejected_logps
    return chosen - rejected, beta * chosen.detach(), beta * rejected.detach()


def sigmoid_loss(b: PrefInputs, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0):
    h, rc, rr = _ref_rewards(b, beta)
    return _smoothed(beta * h, label_smoothing), rc, rr


def robust_loss(b: PrefInputs, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0):
    h, rc, rr = _ref_rewards(b, beta)
    e = label_smoothing
    losses = (-(1 - e) * F.logsigmoid(beta * h) + e * F.logsigmoid(-beta * h)) / (1 - 2 * e)
    return losses, rc, rr


def hinge_loss(b: PrefInputs, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0):
    h, rc, rr = _ref_rewards(b, beta)
    return torch.relu(1 - beta * h), rc, rr


def _per_token(b: PrefInputs, *, ref: bool) -> PrefInputs:
    """``b`` with every log-prob divided by its response's length (per-token means)."""
    lc, lr = b.chosen_len.clamp(min=1), b.rejected_len.clamp(min=1)
    return PrefInputs(
        b.chosen_logps / lc,
        b.rejected_logps / lr,
        b.chosen_len,
        b.rejected_len,
        b.ref_chosen_logps / lc if ref else None,
        b.ref_rejected_logps / lr if ref else None,
    )


def ipo_loss(b: PrefInputs, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0):
    """IPO on per-token mean log-ratios (TRL's normalisation); its rewards, as TRL logs them, from the sums."""
    h, _, _ = _ref_rewards(_per_token(b, ref=True), beta)
    _, rc, rr = _ref_rewards(b, beta)
    return (h - 1 / (2 * beta)) ** 2, rc, rr


def simpo_loss(b: PrefInputs, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.5):
    m = _per_token(b, ref=False)
    x = beta * (m.chosen_logps - m.rejected_logps) - gamma
    return _smoothed(x, label_smoothing), beta * m.chosen_logps.detach(), beta * m.rejected_logps.detach()


def orpo_loss(b: PrefInputs, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0):
    m = _per_token(b, ref=False)
    c, r = m.chosen_logps, m.rejected_logps
    # log odds(y) = m - log(1 - exp(m)); m < 0 always (a log-prob), so log1p(-exp(m)) is finite
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    return -beta * F.logsigmoid(log_odds), beta * c.detach(), beta * r.detach()


def kto_loss(b: PrefInputs, *, beta: float, label_smoothing: float = 0.0, gamma: float = 0.0):
    """Rows, not pairs: ``chosen_logps`` / ``ref_chosen_logps`` hold every row's, ``label`` which are good."""
    r = b.chosen_logps - b.ref_chosen_logps
    z0 = b.kl.detach() if b.kl is not None else torch.zeros((), device=r.device)
    good = b.label.bool()
    losses = torch.where(
        good,
        b.desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
        b.undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))),
    )
    reward = beta * r.detach()
    nan = torch.full_like(reward, float("nan"))
    return losses, torch.where(good, reward, nan), torch.where(good, nan, reward)


def kl_estimate(policy_logps: Tensor, ref_logps: Tensor) -> Tensor:
    """KTO's z0: ``max(0, mean(pi - ref))`` over mismatched prompt/completion rows, detached."""
    return (policy_logps - ref_logps).mean().clamp(min=0).detach()


def bradley_terry_loss(
    chosen: Tensor, rejected: Tensor, *, margin: Tensor | float = 0.0, center_coef: float = 0.0
) -> tuple[Tensor, Tensor]:
    """A reward model's loss per pair and whether it ranks the pair right: ``-log s(r_c - r_r - margin)``
    plus TRL's reward centering ``center_coef (r_c + r_r)^2``; (losses [P], correct [P] float)."""
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center_coef:
        losses = losses + center_coef * (chosen + rejected) ** 2
    return losses, (chosen > rejected).float().detach()
