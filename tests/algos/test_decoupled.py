"""rlctl.algos.decoupled against a token-by-token computation written from AReaL's formula."""

from __future__ import annotations

import math

import torch

from rlctl.algos.admission import staleness_metrics
from rlctl.algos.decoupled import decoupled_ppo_loss


def by_hand(lp, prox, behav, adv, eps=0.2, cap=5.0):
    r = math.exp(lp - prox)
    w = math.exp(prox - behav)
    w = 0.0 if w > cap else w
    return -w * min(r * adv, min(max(r, 1 - eps), 1 + eps) * adv)


def test_against_the_formula_token_by_token():
    g = torch.Generator().manual_seed(0)
    lp, prox, behav = (torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.7 for _ in range(3))
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    loss, m = decoupled_ppo_loss(lp, prox, behav, adv, mask, cap=2.0)
    for i in range(3):
        for j in range(5):
            want = by_hand(lp[i, j].item(), prox[i, j].item(), behav[i, j].item(), adv[i, j].item(), cap=2.0)
            assert math.isclose(loss[i, j].item(), want * mask[i, j].item(), rel_tol=1e-9, abs_tol=1e-12)
    assert 0 < m["behav_w_masked"] < 1


def test_fresh_samples_are_ppo():
    lp = torch.tensor([[0.1, -0.3]], requires_grad=True)
    old = torch.tensor([[-0.2, -0.1]])
    adv = torch.tensor([[1.0, -1.0]])
    loss, _ = decoupled_ppo_loss(lp, old, old, adv, torch.ones(1, 2))
    r = torch.exp(lp - old)
    ppo = -torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)
    assert torch.allclose(loss, ppo)


def test_staleness_metrics():
    m = staleness_metrics([0, 1, 1, 2], [1, 2], idle_trainer_s=0.5, idle_rollout_s=0.0, queue_groups=3, max_staleness=2)
    assert m["async/staleness"] == 1.0 and m["async/staleness_max"] == 2.0
    assert m["async/staleness_hist/1"] == 0.5 and m["async/versions_per_trajectory"] == 1.5
