"""rlctl.algos against values worked by hand on tiny tensors (plain python floats)."""

from __future__ import annotations

import math
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from rlctl.algos import (
    AdaptiveKLController,
    FixedKLController,
    advantages,
    aggregate,
    entropy_from_logits,
    gae,
    grpo,
    gspo_policy_loss,
    kl,
    kl_estimate,
    logprobs_from_logits,
    losses,
    masked_mean,
    masked_var,
    masked_whiten,
    ppo_policy_loss,
    reinforce_pp,
    rloo,
    value_loss,
    vocab_parallel,
)
from tests.support.losses import loss_ctx

GARBAGE = float("nan")


def close(actual, expected, tol=1e-5):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.allclose(actual, expected, atol=tol, rtol=tol), (actual, expected)


# ---------------------------------------------------------------------------- masked helpers


def test_masked_helpers_ignore_masked_positions():
    x = torch.tensor([[1.0, 2.0, GARBAGE], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 1]])
    # valid values 1, 2, 4, 6: mean 13/4 = 3.25; squared deviations 5.0625, 1.5625, 0.5625, 7.5625
    # sum 14.75, unbiased variance 14.75 / 3
    close(masked_mean(x, m), 3.25)
    close(masked_var(x, m), 14.75 / 3)
    close(masked_var(x, m, unbiased=False), 14.75 / 4)
    close(masked_mean(x, m, dim=-1), [1.5, 5.0])
    sd = math.sqrt(14.75 / 3 + 1e-8)
    expected = [[(1 - 3.25) / sd, (2 - 3.25) / sd, 0.0], [(4 - 3.25) / sd, 0.0, (6 - 3.25) / sd]]
    close(masked_whiten(x, m), expected)
    close(masked_whiten(x, m, shift_mean=False), [[v + 3.25 if v else 0.0 for v in row] for row in expected])


def test_masked_helpers_degenerate_masks():
    x = torch.tensor([[5.0, 7.0]])
    close(masked_mean(x, torch.zeros(1, 2)), 0.0)
    close(masked_var(x, torch.tensor([[1, 0]])), 0.0)  # one valid value: no variance, no nan


# ---------------------------------------------------------------------------- GRPO / RLOO


def test_grpo_two_groups_by_hand():
    # group "p1" = samples 0, 2 (scores 1, 0); group "p2" = samples 1, 3 (scores 3, 5)
    scores = torch.tensor([1.0, 3.0, 0.0, 5.0])
    ids = ["p1", "p2", "p1", "p2"]
    mean1, mean2 = (1 + 0) / 2, (3 + 5) / 2
    std1 = math.sqrt(((1 - mean1) ** 2 + (0 - mean1) ** 2) / (2 - 1))  # unbiased: sqrt(0.5)
    std2 = math.sqrt(((3 - mean2) ** 2 + (5 - mean2) ** 2) / (2 - 1))  # sqrt(2)
    eps = 1e-6
    expected = [
        (1 - mean1) / (std1 + eps),
        (3 - mean2) / (std2 + eps),
        (0 - mean1) / (std1 + eps),
        (5 - mean2) / (std2 + eps),
    ]
    close(grpo(scores, ids), expected)
    close(grpo(scores, ids, norm_by_std=False), [0.5, -1.0, -0.5, 1.0])


def test_grpo_uses_unbiased_std_and_group_of_one_is_zero():
    scores = torch.tensor([1.0, 0.0, 1.0, 7.0])
    # group of three: mean 2/3, deviations 1/3, -2/3, 1/3, sum of squares 6/9, unbiased var (6/9)/2 = 1/3
    std = math.sqrt(1 / 3)
    expected = [(1 / 3) / (std + 1e-6), (-2 / 3) / (std + 1e-6), (1 / 3) / (std + 1e-6), 0.0]
    close(grpo(scores, [0, 0, 0, 1]), expected)
    # all-equal group: no signal, no division blow-up
    close(grpo(torch.tensor([2.0, 2.0]), [0, 0]), [0.0, 0.0])


def test_group_ids_as_tensor_ints_and_strings_agree():
    scores = torch.tensor([1.0, 3.0, 0.0, 5.0, 2.0])
    a = grpo(scores, torch.tensor([7, 9, 7, 9, 4]))
    b = grpo(scores, [7, 9, 7, 9, 4])
    c = grpo(scores, ["x", "y", "x", "y", "z"])
    close(a, b)
    close(a, c)
    with pytest.raises(ValueError, match="group_ids"):
        grpo(scores, [0, 1])


def test_rloo_by_hand():
    scores = torch.tensor([1.0, 0.0, 1.0, 3.0, 5.0, 7.0])
    ids = ["a", "a", "a", "b", "b", "c"]
    # a: 1 - mean(0, 1) = 0.5; 0 - mean(1, 1) = -1; b: 3 - 5 = -2, 5 - 3 = 2; c alone: 0
    close(rloo(scores, ids), [0.5, -1.0, 0.5, -2.0, 2.0, 0.0])


def test_advantages_carry_no_gradient():
    scores = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not grpo(scores, [0, 0]).requires_grad


# ---------------------------------------------------------------------------- REINFORCE++ / GAE


def test_reinforce_pp_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])  # the 9 sits on a masked token
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # gamma 0.5: row 0 returns 0.25, 0.5, 1; row 1 returns 1, 2 (the masked reward is ignored)
    valid = [0.25, 0.5, 1.0, 1.0, 2.0]
    mean = sum(valid) / 5  # 0.95
    var = sum((v - mean) ** 2 for v in valid) / 4  # 1.8 / 4
    sd = math.sqrt(var + 1e-8)
    expected = [
        [(0.25 - mean) / sd, (0.5 - mean) / sd, (1 - mean) / sd],
        [(1 - mean) / sd, (2 - mean) / sd, 0.0],
    ]
    close(reinforce_pp(rewards, mask, gamma=0.5), expected)


def test_gae_by_hand_and_skips_masked_middle_tokens():
    gamma, lam = 0.9, 0.8
    # row 0: two valid tokens; row 1: the same tokens with a masked (tool output) token between
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 5.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.0], [0.2, 9.0, 0.4]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    a_last = 1.0 + gamma * 0.0 - 0.4  # 0.6: the next value after the last token is 0
    a_first = (0.0 + gamma * 0.4 - 0.2) + gamma * lam * a_last  # 0.16 + 0.432 = 0.592
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    close(ret, [[a_first + 0.2, a_last + 0.4, 0.0], [a_first + 0.2, 0.0, a_last + 0.4]])
    raw = [a_first, a_last, a_first, a_last]
    mean = sum(raw) / 4
    sd = math.sqrt(sum((v - mean) ** 2 for v in raw) / 3 + 1e-8)
    w1, w2 = (a_first - mean) / sd, (a_last - mean) / sd
    close(adv, [[w1, w2, 0.0], [w1, 0.0, w2]])


def test_gae_default_gamma_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.75]])
    _, ret = gae(rewards, values, torch.ones(1, 3))
    close(ret, [[1.0, 1.0, 1.0]])  # gamma = lambda = 1: the return of each token is the final reward


# ---------------------------------------------------------------------------- aggregation


def test_aggregate_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, GARBAGE], [4.0, GARBAGE, GARBAGE]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(aggregate(loss, mask, "token-mean"), (1 + 2 + 4) / 3)
    close(aggregate(loss, mask, "seq-mean-token-sum"), ((1 + 2) + 4) / 2)
    close(aggregate(loss, mask, "seq-mean-token-mean"), ((1 + 2) / 2 + 4 / 1) / 2)
    close(aggregate(loss, mask, "seq-mean-token-sum-norm"), 7 / (2 * 3))  # norm_len defaults to T = 3
    close(aggregate(loss, mask, "seq-mean-token-sum-norm", norm_len=4), 7 / (2 * 4))
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        aggregate(loss, mask, "token_mean")


@pytest.mark.parametrize("mode", losses.AGG_MODES)
def test_dp_contract_split_batch_sums_to_full_batch(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    lengths = [5, 1, 3, 4, 2, 5]
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    base = torch.randn(B, T, generator=g, dtype=torch.float64)

    def grad_of(pieces):
        x = base.clone().requires_grad_(True)
        total = sum(aggregate(x[s] ** 2, mask[s], mode, **kw) for s, kw in pieces)
        total.backward()
        return total.detach(), x.grad

    full, full_grad = grad_of([(slice(0, B), {})])
    counts = {"global_tokens": int(mask.sum()), "global_seqs": B, "norm_len": T}
    split, split_grad = grad_of([(slice(0, 2), counts), (slice(2, B), counts)])  # uneven halves
    close(split, full, tol=1e-12)
    close(split_grad, full_grad, tol=1e-12)
    # the contract matters: the two ranks' local means averaged (the naive DP way) differ
    if mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        naive = (aggregate(base[:2] ** 2, mask[:2], mode) + aggregate(base[2:] ** 2, mask[2:], mode)) / 2
        assert not torch.allclose(naive, full)


def test_dp_contract_counts_may_be_tensors():
    loss = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.ones(2, 2)
    close(aggregate(loss, mask, "token-mean", global_tokens=torch.tensor(8)), 10 / 8)
    close(aggregate(loss, mask, "seq-mean-token-mean", global_seqs=torch.tensor(4.0)), (1.5 + 3.5) / 4)


# ---------------------------------------------------------------------------- PPO policy loss


def _ppo_example():
    # token ratios 1.5, 0.5, 0.5 | 5.0, masked, masked; advantages +1, +1, -1 | -1
    ratios = torch.tensor([[1.5, 0.5, 0.5], [5.0, 1.0, 1.0]])
    old = torch.full((2, 3), -1.0)
    logp = old + ratios.log()
    logp[1, 1] = 1e4  # garbage on masked tokens must not leak into the loss or its gradient
    old[1, 2] = GARBAGE
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, GARBAGE, GARBAGE]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return logp, old, adv, mask


def test_ppo_loss_by_hand():
    logp, old, adv, mask = _ppo_example()
    # per token: max(-A r, -A clamp(r, 0.8, 1.2)):
    #   r=1.5, A=+1: max(-1.5, -1.2) = -1.2  (clipped)
    #   r=0.5, A=+1: max(-0.5, -0.8) = -0.5
    #   r=0.5, A=-1: max(0.5, 0.8) = 0.8     (clipped); dual clip min(3, 0.8) = 0.8
    #   r=5.0, A=-1: max(5.0, 1.2) = 5.0;    dual clip min(3, 5.0) = 3.0
    loss, metrics = ppo_policy_loss(loss_ctx("ppo", logp.requires_grad_(True), old, adv, mask))
    close(loss, (-1.2 - 0.5 + 0.8 + 3.0) / 4)
    close(metrics["clip_frac"], 2 / 4)
    close(metrics["dual_clip_frac"], 1 / 4)
    close(metrics["approx_kl"], (-math.log(1.5) + math.log(2) + math.log(2) - math.log(5)) / 4)
    loss.backward()
    # only the unclipped token moves: d(-A r)/d logp = -A r = -0.5, over 4 tokens
    close(logp.grad, [[0.0, -0.5 / 4, 0.0], [0.0, 0.0, 0.0]])

    no_dual, m2 = ppo_policy_loss(loss_ctx("ppo", logp.detach(), old, adv, mask, dual_clip=None))
    close(no_dual, (-1.2 - 0.5 + 0.8 + 5.0) / 4)
    close(m2["dual_clip_frac"], 0.0)
    higher, _ = ppo_policy_loss(loss_ctx("ppo", logp.detach(), old, adv, mask, clip_high=0.28))
    close(higher, (-1.28 - 0.5 + 0.8 + 3.0) / 4)
    seq, _ = ppo_policy_loss(loss_ctx("ppo", logp.detach(), old, adv, mask, agg="seq-mean-token-mean"))
    close(seq, ((-1.2 - 0.5 + 0.8) / 3 + 3.0) / 2)


def test_ppo_sequence_advantages_broadcast():
    logp, old, _, mask = _ppo_example()
    per_seq = torch.tensor([1.0, -1.0])
    a, _ = ppo_policy_loss(loss_ctx("ppo", logp, old, per_seq, mask))
    b, _ = ppo_policy_loss(loss_ctx("ppo", logp, old, per_seq[:, None].expand(2, 3), mask))
    close(a, b)


def test_ppo_log_ratio_is_clamped():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[30.0, -30.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, _ = ppo_policy_loss(loss_ctx("ppo", logp, old, adv, torch.tensor([[1, 0]]), dual_clip=None))
    close(loss, math.exp(20.0), tol=1e-5)  # exp(30) would be 1e13
    loss, _ = ppo_policy_loss(loss_ctx("ppo", logp, old, adv, torch.tensor([[0, 1]]), dual_clip=None))
    close(loss, -math.exp(-20.0))  # A > 0: max(-exp(-20), -0.8), a low ratio is not clipped
    loss, _ = ppo_policy_loss(loss_ctx("ppo", logp, old, adv, torch.tensor([[1, 0]])))
    close(loss, 3.0)


def test_dual_clip_must_exceed_one():
    logp, old, adv, mask = _ppo_example()
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(loss_ctx("ppo", logp, old, adv, mask, dual_clip=1.0))


# ---------------------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_and_straight_through_gradient():
    old = torch.tensor([[-1.0, -2.0, -1.0], [-0.5, -0.5, -0.5]], dtype=torch.float64)
    delta = torch.tensor([[0.1, 0.3, 7.0], [-0.2, 0.0, 0.0]], dtype=torch.float64)  # 7.0 is masked
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    s0, s1 = math.exp((0.1 + 0.3) / 2), math.exp(-0.2 / 1)  # sequence ratios from mean log-ratios
    logp = (old + delta).requires_grad_(True)
    loss, metrics = gspo_policy_loss(loss_ctx("gspo", logp, old, adv, mask, clip_low=0.5, clip_high=0.5))
    # unclipped: seq-mean-token-mean of -A s = (-(+1) s0 + -(-1) s1) / 2
    close(loss, (-s0 + s1) / 2, tol=1e-12)
    close(metrics["clip_frac"], 0.0)
    loss.backward()
    # each token's gradient is -A * s_b / (B * |y_b|): the sequence ratio, not the token ratio
    close(logp.grad, [[-s0 / (2 * 2), -s0 / (2 * 2), 0.0], [s1 / (2 * 1), 0.0, 0.0]], tol=1e-12)

    # same gradient as differentiating the sequence-level objective directly
    x = (old + delta).requires_grad_(True)
    seq = torch.exp(((x - old) * mask).sum(-1) / mask.sum(-1))
    (-(adv * seq).mean()).backward()
    close(logp.grad, x.grad, tol=1e-12)


def test_gspo_default_clip_range_is_tiny():
    old = torch.zeros(1, 2)
    logp = torch.tensor([[0.1, 0.3]], requires_grad=True)
    loss, metrics = gspo_policy_loss(loss_ctx("gspo", logp, old, torch.tensor([1.0]), torch.ones(1, 2)))
    close(loss, -(1 + 4e-4))  # s = exp(0.2) is clipped to 1 + 4e-4
    close(metrics["clip_frac"], 1.0)
    loss.backward()
    close(logp.grad, [[0.0, 0.0]])


# ---------------------------------------------------------------------------- value loss


def test_value_loss_by_hand():
    v = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.8, 1.0, 0.0]])
    ret = torch.tensor([[1.5, 2.2, GARBAGE]])
    mask = torch.tensor([[1, 1, 0]])
    # token 0: clamp(1.0, 0.3, 1.3) = 1.0: max(0.25, 0.25) = 0.25
    # token 1: clamp(2.0, 0.5, 1.5) = 1.5: max((2 - 2.2)^2 = 0.04, (1.5 - 2.2)^2 = 0.49) = 0.49
    loss, metrics = value_loss(v, old, ret, mask)
    close(loss, 0.5 * (0.25 + 0.49) / 2)
    close(metrics["vf_clip_frac"], 0.5)
    loss.backward()
    close(v.grad, [[0.5 * 2 * (1.0 - 1.5) / 2, 0.0, 0.0]])  # clipped token: no gradient
    plain, _ = value_loss(v.detach(), old, ret, mask, clip=None)
    close(plain, 0.5 * (0.25 + 0.04) / 2)


# ---------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand_and_aliases():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # d = logp - ref = 0.5, -1.0; x = ref - logp = -0.5, 1.0
    close(kl_estimate(logp, ref, "k1"), [0.5, -1.0])
    close(kl_estimate(logp, ref, "abs"), [0.5, 1.0])
    close(kl_estimate(logp, ref, "k2"), [0.125, 0.5])
    close(kl_estimate(logp, ref, "k3"), [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1])
    for alias, kind in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")]:
        close(kl_estimate(logp, ref, alias), kl_estimate(logp, ref, kind))


def test_k3_clamps():
    logp = torch.tensor([0.0, 0.0, 0.0])
    ref = torch.tensor([30.0, -30.0, -3.0])
    # x = 30 -> clamped to 20: exp(20) - 21 -> clamped to 10; x = -30 -> -20: exp(-20) + 19 -> 10
    # x = -3: exp(-3) + 3 - 1 = 2.0498 (inside the clamp)
    close(kl_estimate(logp, ref, "low_var_kl"), [10.0, 10.0, math.exp(-3) + 2])


def test_unknown_kl_kind_lists_kinds():
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(10.0, 1000)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(0.1, target=0.1, horizon=10000)
    ctl.update(0.3, 1000)  # e = clamp(0.3/0.1 - 1 = 2, -0.2, 0.2) = 0.2: coef * (1 + 0.2 * 0.1)
    assert ctl.value == pytest.approx(0.1 * 1.02)
    ctl.update(0.05, 1000)  # e = clamp(-0.5) = -0.2: coef * (1 - 0.02)
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.98)
    ctl.update(torch.tensor(0.11), 1000)  # e = 0.1 (inside the clamp): coef * 1.01
    assert ctl.value == pytest.approx(0.1 * 1.02 * 0.98 * 1.01)


# ---------------------------------------------------------------------------- entropy, log-probs


def test_entropy_by_hand_and_stable():
    logits = torch.tensor([[0.0, math.log(3.0)], [1000.0, 1000.0]])
    # probabilities 1/4, 3/4: -(0.25 ln 0.25 + 0.75 ln 0.75); two equal huge logits: ln 2
    expected = [-(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2)]
    close(entropy_from_logits(logits), expected)
    close(entropy_from_logits(torch.full((3, 5), 7.0, dtype=torch.bfloat16)), [math.log(5)] * 3)


def test_logprobs_by_hand_with_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    close(logprobs_from_logits(logits, torch.tensor([[1]])), [[math.log(0.75)]])
    # temperature 2: softmax of (0, ln3 / 2) = (1, sqrt 3) / (1 + sqrt 3)
    close(logprobs_from_logits(logits, torch.tensor([[0]]), temperature=2.0), [[-math.log(1 + math.sqrt(3))]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_log_softmax_values_and_grads(monkeypatch, dtype, temperature):
    monkeypatch.setattr(vocab_parallel, "CHUNK_ELEMENTS", 7 * 11)  # 7 rows per chunk: ragged last chunk
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(3, 10, 11, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 11, (3, 10), generator=g)
    upstream = torch.randn(3, 10, generator=g, dtype=torch.float64)

    ref_in = logits.detach().double().requires_grad_(True)
    ref = torch.log_softmax(ref_in / temperature, -1).gather(-1, labels[..., None]).squeeze(-1)
    (ref * upstream).sum().backward()

    x = logits.detach().requires_grad_(True)
    out = logprobs_from_logits(x, labels, temperature=temperature)
    assert out.dtype == torch.float32 and out.shape == (3, 10)
    (out.double() * upstream).sum().backward()
    assert x.grad.dtype == dtype
    close(out, ref.detach(), tol=1e-5)
    close(x.grad.double(), ref_in.grad, tol=1e-5 if dtype == torch.float32 else 1e-2)


def test_logprobs_non_contiguous_input():
    logits = torch.randn(2, 6, 9)
    labels = torch.randint(0, 9, (2, 5))
    sliced = logits[:, :-1]
    expected = torch.log_softmax(sliced, -1).gather(-1, labels[..., None]).squeeze(-1)
    close(logprobs_from_logits(sliced, labels), expected)


def test_module_paths_are_public():
    assert advantages.grpo is grpo and kl.kl_estimate is kl_estimate and losses.aggregate is aggregate
    assert advantages.masked_whiten is masked_whiten


def test_logprobs_keep_no_float32_copy_for_backward():
    logits = torch.randn(2, 8, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 8))

    def saved_by(f):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            f()
        return [t for t in saved if t.dtype == torch.float32 and t.numel() >= logits.numel()]

    naive = saved_by(lambda: torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]))
    assert naive  # the check can see a float32 copy when there is one
    assert not saved_by(lambda: logprobs_from_logits(logits, labels))


# ---------------------------------------------------------------------------------------------
# Registries


def test_policy_losses_carry_their_own_defaults_and_user_keys_win():
    from rlctl.algos import resolve_policy_loss

    gspo = resolve_policy_loss("gspo", clip_low=None, clip_high=None, dual_clip=None, agg=None)
    assert (gspo.clip_low, gspo.clip_high, gspo.dual_clip, gspo.agg) == (3e-4, 4e-4, None, "seq-mean-token-mean")
    ppo = resolve_policy_loss("ppo", clip_low=None, clip_high=None, dual_clip=None, agg=None)
    assert (ppo.clip_low, ppo.clip_high, ppo.dual_clip, ppo.agg) == (0.2, 0.2, 3.0, "token-mean")
    mixed = resolve_policy_loss("gspo", clip_low=None, clip_high=0.28, dual_clip=None, agg="token-mean")
    assert (mixed.clip_low, mixed.clip_high, mixed.agg) == (3e-4, 0.28, "token-mean")
    off = resolve_policy_loss("ppo", clip_low=None, clip_high=None, dual_clip=0.0, agg=None)
    assert off.dual_clip is None  # 0 set by the user turns the dual clip off


def test_unknown_algorithm_names_are_one_line_user_errors():
    from rlctl.algos import get_adv_estimator, get_policy_loss
    from rlctl.errors import UserError

    with pytest.raises(UserError, match=r"algo.policy_loss='gpso' \(did you mean gspo") as e:
        get_policy_loss("gpso")
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="choose one of grpo, rloo, reinforce_pp, gae"):
        get_adv_estimator("ppo")


def test_a_registered_policy_loss_is_selected_by_name():
    from rlctl.algos import POLICY_LOSSES, register_policy_loss, resolve_policy_loss

    @register_policy_loss("test_plain_pg", clip_low=0.0, clip_high=0.0, dual_clip=None, agg="seq-mean-token-sum")
    def plain_pg(ctx):
        return -(ctx.advantages * ctx.logp * ctx.mask).sum(), {}

    try:
        s = resolve_policy_loss("test_plain_pg", clip_low=None, clip_high=None, dual_clip=None, agg=None)
        assert s.loss.fn is plain_pg and s.agg == "seq-mean-token-sum"
    finally:
        del POLICY_LOSSES["test_plain_pg"]


def test_registered_estimators_match_the_formulas():
    from rlctl.algos import ADV_ESTIMATORS

    rewards = torch.zeros(4, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.float32)
    for i, (last, score) in enumerate([(1, 1.0), (2, 0.0), (0, 3.0), (1, 1.0)]):
        rewards[i, last] = score
    adv, ret = ADV_ESTIMATORS["grpo"].fn(rewards, mask, n=2, norm_by_std=False)
    want = torch.tensor([0.5, -0.5, 1.0, -1.0])[:, None] * mask  # score minus its pair's mean
    assert torch.allclose(adv, want) and torch.equal(adv, ret)
    adv, _ = ADV_ESTIMATORS["rloo"].fn(rewards, mask, n=2)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 2.0, -2.0])[:, None] * mask)  # minus the other one
    assert ADV_ESTIMATORS["gae"].needs_critic and not ADV_ESTIMATORS["grpo"].needs_critic
    assert ADV_ESTIMATORS["grpo"].needs_groups and not ADV_ESTIMATORS["reinforce_pp"].needs_groups
