"""rlctl.algos.correction.is_weights against hand computations and an independent, loop-by-loop
re-implementation of verl's rollout-correction semantics (rollout_corr_helper: IS weights, TIS/MIS,
geometric rejection, IS metrics and the off-policy KL) on random batches."""

from __future__ import annotations

import math
import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from rlctl.algos.correction import is_weights, parse_threshold
from tests.support.losses import loss_ctx


def close(actual, expected, tol=1e-6):
    a = torch.as_tensor(actual, dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    assert torch.allclose(a, e, atol=tol, rtol=tol), (a, e)


def test_token_tis_by_hand():
    # ratios 1, e (>2: truncated to 2), 0.5 ; second row: 1.5 and padding (garbage)
    lr = torch.tensor([[0.0, 1.0, math.log(0.5)], [math.log(1.5), float("nan"), 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    w, met = is_weights(lr, m, level="token", threshold=2.0, mode="tis")
    close(w, [[1.0, 2.0, 0.5], [1.5, 0.0, 0.0]])
    raw = [1.0, math.e, 0.5, 1.5]
    close(met["is_mean"], sum(raw) / 4)
    close(met["is_max"], math.e)
    close(met["is_min"], 0.5)
    close(met["is_frac_high"], 0.25)
    close(met["is_frac_low"], 0.0)  # 0.5 is not below 1/2
    close(met["is_frac_truncated"], 0.25)
    clamped = [1.0, 2.0, 0.5, 1.5]  # clamped to [0.5, 2] for std and ESS
    mc = sum(clamped) / 4
    close(met["is_std"], math.sqrt(sum(c * c for c in clamped) / 4 - mc * mc))
    close(met["is_ess"], 1 / (sum((c / (mc + 1e-8)) ** 2 for c in clamped) / 4))
    lrs = [0.0, 1.0, math.log(0.5), math.log(1.5)]
    close(met["mismatch_kl_k1"], -sum(lrs) / 4)
    close(met["mismatch_kl_k3"], sum(math.exp(x) - x - 1 for x in lrs) / 4)


def test_token_mis_and_sequence_level_by_hand():
    lr = torch.tensor([[0.1, 0.2, 0.0], [-1.0, 0.5, 0.3]])
    m = torch.tensor([[1, 1, 0], [1, 1, 1]])
    w, met = is_weights(lr, m, level="token", threshold="0.5_1.2", mode="mis")
    # exp(0.2) = 1.2214 > 1.2 -> 0; exp(-1) = 0.368 < 0.5 -> 0; exp(0.3) = 1.35 -> 0
    close(w, [[math.exp(0.1), 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(met["is_frac_masked"], 4 / 5)
    # sequence level: row sums 0.3 and -0.2; weights e^0.3 (> 1.2, truncated) and e^-0.2
    w, met = is_weights(lr, m, level="sequence", threshold=1.2, mode="tis")
    close(w, [[1.2, 1.2, 0.0], [math.exp(-0.2)] * 3])
    close(met["is_max"], math.exp(0.3))
    close(met["is_min"], math.exp(-0.2))
    close(met["is_frac_high"], 0.5)  # per sequence
    close(met["is_mean"], (2 * math.exp(0.3) + 3 * math.exp(-0.2)) / 5)  # per token


def test_geometric_rejection_drops_whole_sequences():
    lr = torch.tensor([[0.1, 0.1], [2.0, 0.0], [-2.0, -2.0]])
    m = torch.ones(3, 2)
    w, met = is_weights(lr, m, level="token", threshold=100.0, mode="tis", reject=2.0)
    # geometric means e^0.1 (kept), e^1 = 2.72 > 2 (dropped), e^-2 < 0.5 (dropped)
    close(w, [[math.exp(0.1)] * 2, [0.0, 0.0], [0.0, 0.0]])
    close(met["is_seq_rejected"], 2 / 3)


def test_weights_are_detached_and_bad_thresholds_refused():
    lr = torch.zeros(2, 3, requires_grad=True)
    w, _ = is_weights(lr, torch.ones(2, 3))
    assert not w.requires_grad
    assert parse_threshold(2.0) == (0.5, 2.0) and parse_threshold("0.25_4") == (0.25, 4.0)
    assert parse_threshold("2") == (0.5, 2.0)  # a number as a string: verl's float-like form
    for bad in (0.5, "x", "1.5_3", "a_b", float("inf")):
        with pytest.raises(ValueError):
            parse_threshold(bad)


# ------------------------------------------------------------- an independent re-implementation


def _verl_like(lr, m, level, low, high, mode, rs):
    """Loops over python floats, following verl's rollout_corr_helper step by step."""
    B, T = lr.shape
    rows = [[(float(lr[b, t]), bool(m[b, t])) for t in range(T)] for b in range(B)]
    raw, unit = [], []  # per-token raw weights; per-unit unclamped log ratios
    for row in rows:
        if level == "token":
            raw.append([math.exp(min(max(x, -20), 20)) if v else 0.0 for x, v in row])
            unit += [x for x, v in row if v]
        else:
            s = sum(x for x, v in row if v)
            raw.append([math.exp(min(max(s, -20), 20)) if v else 0.0 for _, v in row])
            if any(v for _, v in row):
                unit.append(s)
    vals = [raw[b][t] for b in range(B) for t in range(T) if rows[b][t][1]]
    n = len(vals)
    out = {"is_mean": sum(vals) / n}
    if level == "token":
        out["is_max"], out["is_min"] = max(vals), min(vals)
        out["is_frac_high"] = sum(v > high for v in vals) / n
        out["is_frac_low"] = sum(v < low for v in vals) / n
    else:
        out["is_max"], out["is_min"] = math.exp(min(max(unit), 20)), math.exp(min(unit))
        out["is_frac_high"] = sum(u > math.log(high) for u in unit) / len(unit)
        out["is_frac_low"] = sum(u < math.log(low) for u in unit) / len(unit)
    c = [min(max(v, low), high) for v in vals]
    mc = sum(c) / n
    out["is_std"] = math.sqrt(max(sum(x * x for x in c) / n - mc * mc, 0.0))
    out["is_ess"] = 1.0 / (sum((x / (mc + 1e-8)) ** 2 for x in c) / n)
    xs = [x for row in rows for x, v in row if v]
    out["mismatch_kl_k1"] = sum(-x for x in xs) / n
    out["mismatch_kl_k3"] = sum(math.exp(x) - x - 1 for x in xs) / n
    w = []
    for b in range(B):
        keep = True
        if rs is not None:
            valid = [x for x, v in rows[b] if v]
            g = sum(valid) / max(len(valid), 1)
            keep = math.log(rs[0]) <= g <= math.log(rs[1])
        wb = []
        for t in range(T):
            x = raw[b][t]
            x = min(x, high) if mode == "tis" else (x if low <= x <= high else 0.0)
            wb.append(x if keep else 0.0)
        w.append(wb)
    return w, out


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_matches_verl_semantics_on_random_batches(level, mode):
    gen = torch.Generator().manual_seed(7)
    for trial in range(4):
        B, T = 6, 9
        lr = torch.randn(B, T, generator=gen, dtype=torch.float64) * (0.15 if level == "sequence" else 0.6)
        lens = torch.randint(1, T + 1, (B,), generator=gen)
        m = (torch.arange(T)[None] < lens[:, None]).long()
        threshold, rs = (1.5, None) if trial % 2 else ("0.7_1.8", (0.8, 1.25))
        low, high = parse_threshold(threshold)
        w, met = is_weights(
            lr, m, level=level, threshold=threshold, mode=mode, reject=None if rs is None else "0.8_1.25"
        )
        ref_w, ref = _verl_like(lr, m, level, low, high, mode, rs)
        close(w, ref_w)
        for key, value in ref.items():
            close(met[key], value)


# ------------------------------------------------------------- wiring: config -> AlgoSpec -> loss


def test_correction_is_on_by_default_for_vllm_and_sglang_only():
    from rlctl.config import build_config
    from rlctl.recipes.rl.spec import AlgoSpec

    def spec(engine, **algo):
        return AlgoSpec.from_config(build_config("grpo", [{"rollout": {"engine": engine}, "algo": algo}])).correction

    assert spec("hf") is None
    c = spec("vllm")
    assert (c.mode, c.level, c.threshold, c.reject) == ("tis", "token", 2.0, None)
    assert spec("sglang").mode == "tis"
    assert spec("vllm", rollout_correction="none") is None
    c = spec(
        "hf", rollout_correction="mis", correction_level="sequence", correction_lower=0.5, correction_threshold=3.0
    )
    assert (c.mode, c.level, c.threshold) == ("mis", "sequence", "0.5_3.0")


def test_bad_correction_bounds_are_one_line_errors():
    from rlctl.config import build_config
    from rlctl.config.algorithm import check_algorithm
    from rlctl.errors import UserError

    for algo, words in (
        ({"correction_threshold": 0.5}, "correction_threshold=0.5 must be >= 1"),
        ({"correction_lower": 2.0}, "correction_lower=2.0 must be in (0, 1]"),
        ({"correction_reject": 0.9}, "correction_reject=0.9 must be >= 1"),
    ):
        with pytest.raises(UserError, match=re.escape(words)):
            check_algorithm(build_config("grpo", [{"algo": algo}]))


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "gpg", "sapo", "clip_cov", "kl_cov"])
def test_the_weights_multiply_the_per_token_loss_before_aggregation(name):
    from rlctl.algos.registry import get_policy_loss

    gen = torch.Generator().manual_seed(3)
    old = torch.randn(3, 4, generator=gen, dtype=torch.float64) - 1
    logp = old + 0.1 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    adv = torch.randn(3, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    w = torch.rand(3, 4, generator=gen, dtype=torch.float64) * 2
    fn = get_policy_loss(name).fn
    kw = {"agg": "seq-mean-token-sum"}  # linear in the per-token loss: sum_b sum_t L w / B
    # the loss with weights = the sum of the single-token losses (one token kept at a time), weighted
    torch.manual_seed(0)
    weighted, _ = fn(loss_ctx(name, logp, old, adv, mask, is_weights=w, **kw))
    total = 0.0
    for b in range(3):
        for t in range(4):
            if mask[b, t]:
                one = torch.zeros(3, 4, dtype=torch.float64)
                one[b, t] = w[b, t]
                torch.manual_seed(0)
                total += float(fn(loss_ctx(name, logp, old, adv, mask, is_weights=one, **kw))[0])
    close(weighted, total)
    torch.manual_seed(0)
    plain, _ = fn(loss_ctx(name, logp, old, adv, mask, **kw))
    torch.manual_seed(0)
    ones, _ = fn(loss_ctx(name, logp, old, adv, mask, is_weights=torch.ones(3, 4, dtype=torch.float64), **kw))
    close(plain, ones)


def test_update_reports_the_correction_metrics_per_token():
    from rlctl.algos.correction import Correction
    from rlctl.recipes.rl.update import correction_weights

    class Algo:
        correction = Correction("mis", "token", "0.8_1.25", None)

    old = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout = torch.tensor([[-1.1, -1.0, -0.5]])
    mask = torch.tensor([[1, 1, 0]])
    w, stats = correction_weights(Algo(), old, rollout, mask)
    close(w, [[math.exp(0.1), 0.0, 0.0]])  # exp(-1) is outside [0.8, 1.25]
    close(stats["corr/is_frac_masked"], 1.0)  # 1/2 of 2 tokens, as a sum over tokens
    close(stats["corr/mismatch_kl_k1"], -(0.1 - 1.0))
    Algo.correction = None
    assert correction_weights(Algo(), old, rollout, mask) == (None, {})


def test_the_step0_logprob_check_refuses_far_beyond_the_dtype():
    from rlctl.recipes.rl.trainer import logprob_check_problem

    assert logprob_check_problem(1e-7, "fp32") is None
    assert logprob_check_problem(0.3, "bf16") is None  # bf16 kernels differ this much
    line = logprob_check_problem(0.3, "fp32")
    assert "0.3 per token" in line and "fp32" in line and "--ignore-logprob-check" in line and "\n" not in line
    assert logprob_check_problem(2.0, "bf16") is not None  # a weight-sync bug: nats per token
