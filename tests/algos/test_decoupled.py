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


def areal_loss(lp, prox, behav, adv, mask, *, eps=0.2, eps_high=0.28, c_clip=3.0, cap=5.0):
    """AReaL's ppo_actor_loss_fn (decoupled: proximal_logprobs given), written token by token in plain Python:
    ratio against the proximal policy, PPO clip, dual clip min(pg, sign(A) c A), the behaviour weight
    exp(prox - behav) zeroed above the cap, then the sum over loss-mask tokens / their count."""
    total, count = 0.0, 0
    for i in range(len(lp)):
        for j in range(len(lp[i])):
            if not mask[i][j]:
                continue
            a = adv[i][j]
            r = math.exp(lp[i][j] - prox[i][j])
            pg = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps_high))
            pg = min(pg, math.copysign(1.0, a) * c_clip * a)
            w = math.exp(prox[i][j] - behav[i][j])
            total += (0.0 if w > cap else w) * pg
            count += 1
    return total / count


def test_registered_loss_is_areals_formula_aggregated():
    """algo.policy_loss=decoupled through the registry, on fixed tensors: the scalar equals AReaL's loss by
    hand (token-mean over the mask, dual clip 3, clip-higher 0.28), and the gradient flows through logp only."""
    from rlctl.algos import PolicyLossContext, get_policy_loss

    g = torch.Generator().manual_seed(1)
    lp = (torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.6).requires_grad_()
    prox, behav = (torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.8 for _ in range(2))
    adv = torch.randn(3, 6, generator=g, dtype=torch.float64) * 2
    mask = torch.ones(3, 6)
    mask[1, 4:] = 0
    ctx = PolicyLossContext(
        lp, prox, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg="token-mean", behav_logp=behav
    )
    loss, m = get_policy_loss("decoupled").fn(ctx)
    want = areal_loss(lp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(), eps_high=0.28)
    assert math.isclose(loss.item(), want, rel_tol=1e-12)
    assert 0 < m["behav_w_masked"] < 1 and m["dual_clip_frac"] > 0  # the draw reaches the cap and the dual clip
    loss.backward()
    assert lp.grad is not None and prox.grad is None and behav.grad is None


def test_registered_loss_with_fresh_samples_is_ppo():
    """behaviour = proximal: every weight is 1, and the loss equals the ppo loss with the same settings."""
    from rlctl.algos import PolicyLossContext, get_policy_loss

    g = torch.Generator().manual_seed(2)
    lp, old = (torch.randn(2, 5, generator=g) for _ in range(2))
    adv, mask = torch.randn(2, 5, generator=g), torch.ones(2, 5)
    kw = dict(clip_low=0.2, clip_high=0.2, dual_clip=3.0, agg="seq-mean-token-mean")
    ours, m = get_policy_loss("decoupled").fn(PolicyLossContext(lp, old, adv, mask, **kw, behav_logp=old))
    ppo, _ = get_policy_loss("ppo").fn(PolicyLossContext(lp, old, adv, mask, **kw))
    assert torch.allclose(ours, ppo) and m["behav_w_mean"] == 1.0


def test_decoupled_needs_behaviour_and_turns_the_default_correction_off():
    """Without behav_logp: a one-line error. The rollout correction's default (tis for stale batches) is off
    for decoupled; an explicit one is refused before launch (each token would be weighted twice)."""
    import pytest

    from rlctl.algos import PolicyLossContext, get_policy_loss
    from rlctl.algos.correction import correction_for
    from rlctl.errors import UserError
    from rlctl.support import JobFacts, refuse

    t = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="behav_logp"):
        get_policy_loss("decoupled").fn(PolicyLossContext(t, t, t, torch.ones(1, 2)))
    kw = dict(level="token", upper=2.0, lower=None, reject=None, off_policy=True)
    assert correction_for(None, "hf", **kw) is not None
    assert correction_for(None, "vllm", **kw, loss_weighs_behaviour=True) is None
    refuse(JobFacts(behaviour_loss="decoupled", correction="none"), "behaviour_weighed_twice")
    refuse(JobFacts(behaviour_loss="", correction="tis"), "behaviour_weighed_twice")
    with pytest.raises(UserError, match="would weigh each token twice; drop algo.rollout_correction"):
        refuse(JobFacts(behaviour_loss="decoupled", correction="mis"), "behaviour_weighed_twice")


def test_the_cap_is_a_config_key():
    """algo.decoupled_cap=2.5 reaches the loss through the config (policy_settings -> PolicyLossSettings.call):
    the scalar equals AReaL's formula by hand with cap 2.5, differs from the default cap's (the draw has weights
    between 2.5 and 5), and the printed policy settings name it. The default is AReaL's 5 (one value: the loss's
    keyword default); a cap <= 1 is a one-line error before launch."""
    import re

    import pytest

    from rlctl.algos import PolicyLossContext
    from rlctl.algos.decoupled import DEFAULT_CAP
    from rlctl.config import build_config
    from rlctl.config.algorithm import check_algorithm
    from rlctl.config.schema import AlgoConfig
    from rlctl.errors import UserError
    from rlctl.recipes.rl.spec import AlgoSpec

    assert AlgoConfig().decoupled_cap == DEFAULT_CAP == 5.0
    cfg = build_config("grpo", [{"algo": {"policy_loss": "decoupled", "decoupled_cap": 2.5}}])
    check_algorithm(cfg)
    pl = AlgoSpec.from_config(cfg).policy
    assert pl.as_metrics()["cap"] == 2.5
    g = torch.Generator().manual_seed(4)
    lp, prox = (torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.5 for _ in range(2))
    behav = prox - torch.rand(4, 6, generator=g, dtype=torch.float64) * 2  # weights exp(0..2): 1 to 7.4
    adv, mask = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.ones(4, 6)
    ctx = PolicyLossContext(lp, prox, adv, mask, clip_low=pl.clip_low, clip_high=pl.clip_high, agg=pl.agg,
                            dual_clip=pl.dual_clip, behav_logp=behav)  # fmt: skip
    loss, _ = pl.call(ctx)
    args = (lp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist())
    want = areal_loss(*args, eps_high=0.2, c_clip=float("inf"), cap=2.5)
    assert math.isclose(loss.item(), want, rel_tol=1e-12)
    assert not math.isclose(want, areal_loss(*args, eps_high=0.2, c_clip=float("inf"), cap=5.0), rel_tol=1e-6)
    default = AlgoSpec.from_config(build_config("grpo", [{"algo": {"policy_loss": "decoupled"}}])).policy
    assert default.knobs == (("cap", 5.0),)
    with pytest.raises(UserError, match=re.escape("algo.decoupled_cap=1.0 must be > 1")):
        check_algorithm(build_config("grpo", [{"algo": {"policy_loss": "decoupled", "decoupled_cap": 1.0}}]))
