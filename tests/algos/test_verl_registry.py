"""verl's extra policy losses and advantage estimators, registered under verl's names, against the papers'
formulas worked by hand on tiny tensors (python floats)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from rlctl.algos import estimators as est
from rlctl.algos.losses import PolicyLossContext
from rlctl.algos.registry import get_adv_estimator, get_policy_loss, resolve_policy_loss


def close(actual, expected, tol=1e-6):
    a = torch.as_tensor(actual, dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    assert torch.allclose(a, e, atol=tol, rtol=tol), (a, e)


def sig(x):
    return 1 / (1 + math.exp(-x))


# one batch for the losses: 2 sequences, 3 tokens, the last token of row 1 is padding (garbage)
OLD = [[-1.0, -2.0, -0.5], [-1.5, -0.3, 0.0]]
LR = [[0.5, -0.1, 0.05], [-0.6, 0.0, float("nan")]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = [2.0, -1.0]  # one per sequence


def _batch():
    old = torch.tensor(OLD, dtype=torch.float64)
    lr = torch.tensor(LR, dtype=torch.float64)
    logp = (old + torch.nan_to_num(lr)).requires_grad_(True)
    return logp, old, torch.tensor(ADV, dtype=torch.float64)


def _tokens():
    """(b, t, logp, old, log-ratio, A) for every valid token."""
    for b in range(2):
        for t in range(3):
            if MASK[b, t]:
                yield b, t, OLD[b][t] + LR[b][t], OLD[b][t], LR[b][t], ADV[b]


def _call(name, **kw):
    logp, old, adv = _batch()
    pl = resolve_policy_loss(name, clip_low=None, clip_high=None, dual_clip=None, agg=None)
    settings = {"clip_low": pl.clip_low, "clip_high": pl.clip_high, "dual_clip": pl.dual_clip, "agg": pl.agg}
    loss, m = pl.loss.fn(PolicyLossContext(logp, old, adv, MASK, **settings), **kw)
    loss.backward()
    assert set(m) >= {"clip_frac", "dual_clip_frac", "approx_kl"}
    close(m["approx_kl"], -sum(x[4] for x in _tokens()) / 5)
    return loss, m, logp.grad


def test_cispo_by_hand():
    loss, m, grad = _call("cispo")  # defaults: clip_low 10 (no lower clip), clip_high 0.2, token-mean
    terms, grads, n_clip = [], {}, 0
    for b, t, lp, _, lr, a in _tokens():
        w = min(math.exp(lr), 1.2)
        n_clip += math.exp(lr) > 1.2
        terms.append(-w * a * lp)
        grads[b, t] = -w * a / 5
    close(loss, sum(terms) / 5)
    close(m["clip_frac"], n_clip / 5)  # exp(0.5) = 1.65 > 1.2
    for (b, t), g in grads.items():
        close(grad[b, t], g)
    close(grad[1, 2], 0.0)


def test_gpg_by_hand():
    loss, _, grad = _call("gpg")
    close(loss, sum(-a * lp for _, _, lp, _, _, a in _tokens()) / 5)
    close(grad[0, 0], -2.0 / 5)


def test_geo_mean_by_hand():
    loss, m, _ = _call("geo_mean")  # clip 0.4 / 0.4 in log space
    # row 0, A = 2 > 0: min(lr, clamp(lr)) = 0.4, -0.1, 0.05 -> mean 0.35/3
    # row 1, A = -1 < 0: -min(-lr, -clamp(lr)) = max(lr, clamp(lr)): -0.6 -> max(-0.6, -0.4) = -0.4; 0.0
    r0 = math.exp((0.4 - 0.1 + 0.05) / 3)
    r1 = math.exp((-0.4 + 0.0) / 2)
    close(loss, (-2.0 * r0 + 1.0 * r1) / 2)
    close(m["clip_frac"], 2 / 5)


def test_sapo_by_hand():
    loss, _, _ = _call("sapo")  # tau_pos 1.0, tau_neg 1.05, seq-mean-token-mean
    rows = {0: [], 1: []}
    for b, _, _, _, lr, a in _tokens():
        tau = 1.0 if a > 0 else 1.05
        rows[b].append(-a * sig(tau * (math.exp(lr) - 1)) * 4 / tau)
    close(loss, sum(sum(v) / len(v) for v in rows.values()) / 2)


def test_clip_cov_and_kl_cov_by_hand():
    # 5 valid tokens: ratio 2e-4 * 5 -> max(1, 0) = 1 token selected
    adv_t = [a for *_, a in _tokens()]
    lp_t = [lp for _, _, lp, *_ in _tokens()]
    ma, ml = sum(adv_t) / 5, sum(lp_t) / 5
    cov = [(a - ma) * (lp - ml) for a, lp in zip(adv_t, lp_t)]
    # kl_cov: -A ratio everywhere, + 0.1 |lr| on the token of largest covariance
    top = max(range(5), key=lambda i: cov[i])
    terms = [-a * math.exp(lr) for *_, lr, a in _tokens()]
    terms[top] += 0.1 * abs(LR[0][top] if top < 3 else LR[1][top - 3])
    loss, m, _ = _call("kl_cov")
    close(loss, sum(terms) / 5)
    close(m["clip_frac"], 1 / 5)
    # clip_cov: candidates are tokens the PPO clip left alone with lb < cov < ub. cov = .708, -1.212, .768,
    # 1.818, -1.422; PPO clips tokens 0 and 3, so (0.7, 1.0) leaves token 2 alone as candidate
    lo, hi = 0.7, 1.0
    ppo = []
    for *_, lr, a in _tokens():
        r = math.exp(lr)
        ppo.append(max(-a * r, -a * min(max(r, 0.8), 1.2)))
    clipped_by_ppo = [-a * min(max(math.exp(lr), 0.8), 1.2) > -a * math.exp(lr) for *_, lr, a in _tokens()]
    loss, m, grad = _call("clip_cov", clip_cov_lb=lo, clip_cov_ub=hi)
    cut = [i for i in range(5) if lo < cov[i] < hi and not clipped_by_ppo[i]]
    assert cut == [2]
    close(grad[0, 2], 0.0)  # its gradient is cut
    close(loss, sum(v for i, v in enumerate(ppo) if i not in cut) / 5)
    close(m["clip_frac"], len(cut) / 5)


# ---------------------------------------------------------------------------- estimators

R = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
M = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 0, 0]])
S = [1.0, 0.5, 0.0, 2.0]  # scores; groups (n=2): {1, 0.5}, {0, 2}


def _est(name, **kw):
    return get_adv_estimator(name).fn(R, M, n=2, values=None, gamma=1.0, lam=1.0, norm_by_std=True, **kw)


def _rows(adv):
    return [float(adv[b][M[b].bool()][0]) for b in range(4)]


def test_grpo_passk_by_hand():
    adv, _ = _est("grpo_passk")
    std1, std2 = math.sqrt(0.125), math.sqrt(2.0)  # unbiased std of {1, .5} and {0, 2}
    close(_rows(adv), [0.5 / (std1 + 1e-6), 0.0, 0.0, 2.0 / (std2 + 1e-6)])
    adv, _ = get_adv_estimator("grpo_passk").fn(R, M, n=2, norm_by_std=False)
    close(_rows(adv), [0.5, 0.0, 0.0, 2.0])
    close(adv * (1 - M), torch.zeros(4, 3))


def test_reinforce_plus_plus_baseline_by_hand():
    adv, ret = _est("reinforce_plus_plus_baseline")
    centred = [0.25, -0.25, -1.0, 1.0]
    toks = [c for c, row in zip(centred, M) for v in row if v]  # 3 + 2 + 1 + 1 tokens
    mu = sum(toks) / len(toks)
    sd = math.sqrt(sum((x - mu) ** 2 for x in toks) / (len(toks) - 1) + 1e-8)
    close(_rows(adv), [(c - mu) / sd for c in centred])
    close(ret, adv)


def test_opo_by_hand():
    adv, _ = _est("opo")
    b1 = (3 * 1.0 + 2 * 0.5) / 5  # length-weighted baselines
    b2 = (1 * 0.0 + 1 * 2.0) / 2
    close(_rows(adv), [1.0 - b1, 0.5 - b1, 0.0 - b2, 2.0 - b2])


def test_gpg_estimator_by_hand():
    adv, _ = _est("gpg")
    alpha = 4 / 3  # three non-zero scores of four
    close(_rows(adv), [alpha * 0.25, alpha * -0.25, alpha * -1.0, alpha * 1.0])


def test_remax_by_hand():
    adv, ret = est.remax_advantages(R, M, reward_baselines=torch.tensor([0.5, 0.5, 1.0, 1.0]))
    close(ret[0], [1.0, 1.0, 1.0])  # reward-to-go
    close(adv[0], [0.5, 0.5, 0.5])
    close(adv[1], [0.0, 0.0, 0.0])
    close(adv[3], [1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="greedy"):
        est.remax_advantages(R, M)


@pytest.mark.parametrize(
    "name,defaults",
    [
        ("cispo", (10.0, 0.2, None, "token-mean")),
        ("gpg", (0.2, 0.2, None, "token-mean")),
        ("geo_mean", (0.4, 0.4, None, "seq-mean-token-mean")),
        ("clip_cov", (0.2, 0.2, None, "token-mean")),
        ("kl_cov", (0.2, 0.2, None, "token-mean")),
        ("sapo", (0.2, 0.2, None, "seq-mean-token-mean")),
    ],
)
def test_registered_under_verls_names_with_their_defaults(name, defaults):
    loss = get_policy_loss(name)
    assert (loss.clip_low, loss.clip_high, loss.dual_clip, loss.agg) == defaults
    for adv in ("grpo_passk", "reinforce_plus_plus_baseline", "opo", "gpg"):
        assert get_adv_estimator(adv).needs_groups and not get_adv_estimator(adv).needs_critic


def test_the_dr_grpo_preset_is_grpo_without_std_and_with_the_length_norm():
    from rlctl.config import build_config
    from rlctl.presets import method_layers
    from rlctl.recipes.rl.spec import AlgoSpec

    spec = AlgoSpec.from_config(build_config("grpo", method_layers("grpo", "dr-grpo")))
    assert spec.adv == "grpo" and spec.norm_by_std is False
    assert spec.policy.agg == "seq-mean-token-sum-norm" and spec.norm_len == 1024  # the grpo preset's max length
    # and the estimator it names gives s - mean_g (no std), the aggregation sum / (B * norm_len)
    adv, _ = get_adv_estimator("grpo").fn(R, M.float(), n=2, norm_by_std=spec.norm_by_std)
    close(_rows(adv), [0.25, -0.25, -1.0, 1.0])


def test_dapo_soft_overlong_penalty_by_hand():
    from rlctl.algos.shaping import overlong_penalty

    # cap 20, buffer 4: no penalty up to 16 tokens, then (16 - L) / 4 down to -1 at 20, -1 beyond
    lengths = torch.tensor([3, 16, 17, 18, 20, 25])
    close(overlong_penalty(lengths, 20, 4), [0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_penalty(lengths, 20, 4, factor=0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    close(overlong_penalty(lengths, 20, 0), [0.0] * 6)
    with pytest.raises(ValueError, match="longer than the generation cap"):
        overlong_penalty(lengths, 20, 21)
