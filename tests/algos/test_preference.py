"""The DPO family's losses (rlctl.algos.preference) against the papers' formulas worked by hand with the
math module on fixed log-probs, and against TRL's own loss functions where TRL is installed; the reward
model's Bradley-Terry loss and accuracy by hand; the registry's errors."""

from __future__ import annotations

import math

import pytest
import torch

from rlctl.algos.preference import PREF_LOSSES, get_pref_loss, register_pref_loss
from rlctl.algos.preference_losses import PrefInputs, bradley_terry_loss, kl_estimate
from rlctl.errors import UserError

# three pairs: summed log-probs of the policy and the reference, and the responses' lengths
PI_C, PI_R = [-12.0, -30.5, -7.25], [-14.5, -28.0, -9.0]
REF_C, REF_R = [-13.0, -29.0, -8.0], [-13.5, -29.5, -8.5]
LEN_C, LEN_R = [6, 15, 4], [7, 12, 5]
BETA = 0.3


def _inputs(**kw) -> PrefInputs:
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return PrefInputs(t(PI_C), t(PI_R), t(LEN_C), t(LEN_R), t(REF_C), t(REF_R), **kw)


def _logsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _h(i: int, *, mean: bool = False) -> float:
    lc, lr = (LEN_C[i], LEN_R[i]) if mean else (1, 1)
    return (PI_C[i] - REF_C[i]) / lc - (PI_R[i] - REF_R[i]) / lr


def _by_hand(name: str, i: int, e: float, gamma: float) -> float:
    """Each paper's per-pair loss with beta = BETA, label smoothing ``e``, SimPO's ``gamma``."""
    b = BETA
    if name == "sigmoid":  # DPO (Rafailov et al. 2023), cDPO's smoothing
        return -(1 - e) * _logsig(b * _h(i)) - e * _logsig(-b * _h(i))
    if name == "robust":  # Chowdhury et al. 2024
        return (-(1 - e) * _logsig(b * _h(i)) + e * _logsig(-b * _h(i))) / (1 - 2 * e)
    if name == "hinge":  # SLiC
        return max(0.0, 1 - b * _h(i))
    if name == "ipo":  # Azar et al. 2023, on per-token means as TRL computes them
        return (_h(i, mean=True) - 1 / (2 * b)) ** 2
    mc, mr = PI_C[i] / LEN_C[i], PI_R[i] / LEN_R[i]
    if name == "simpo":  # Meng et al. 2024
        x = b * mc - b * mr - gamma
        return -(1 - e) * _logsig(x) - e * _logsig(-x)
    if name == "orpo":  # Hong et al. 2024: the odds-ratio term (the NLL term is the recipe's)
        odds = lambda m: math.exp(m) / (1 - math.exp(m))  # noqa: E731
        return -b * _logsig(math.log(odds(mc)) - math.log(odds(mr)))
    raise AssertionError(name)


PAIRED = ["sigmoid", "robust", "hinge", "ipo", "simpo", "orpo"]


@pytest.mark.parametrize("name", PAIRED)
@pytest.mark.parametrize("e", [0.0, 0.1])
def test_each_paired_loss_is_its_papers_formula(name, e):
    losses, chosen, rejected = get_pref_loss(name).fn(_inputs(), beta=BETA, label_smoothing=e, gamma=0.5)
    assert losses.tolist() == pytest.approx([_by_hand(name, i, e, 0.5) for i in range(3)], rel=1e-12)
    if get_pref_loss(name).needs_ref:  # TRL's rewards/chosen and rewards/rejected
        want_c = [BETA * (PI_C[i] - REF_C[i]) for i in range(3)]  # ipo too: TRL logs the summed log-ratios
        want_r = [BETA * (PI_R[i] - REF_R[i]) for i in range(3)]
    else:  # reference-free: beta times the per-token mean log-prob
        want_c = [BETA * PI_C[i] / LEN_C[i] for i in range(3)]
        want_r = [BETA * PI_R[i] / LEN_R[i] for i in range(3)]
    assert chosen.tolist() == pytest.approx(want_c, rel=1e-12)
    assert rejected.tolist() == pytest.approx(want_r, rel=1e-12)


def test_at_the_start_dpo_is_ln2_and_its_gradient_favours_the_chosen():
    pol_c = torch.tensor([-5.0, -9.0], requires_grad=True)
    pol_r = torch.tensor([-6.0, -8.0], requires_grad=True)
    b = PrefInputs(pol_c, pol_r, torch.ones(2), torch.ones(2), pol_c.detach(), pol_r.detach())
    losses, _, _ = get_pref_loss("sigmoid").fn(b, beta=0.1)
    assert losses.tolist() == pytest.approx([math.log(2)] * 2)
    losses.sum().backward()
    assert (pol_c.grad < 0).all() and (pol_r.grad > 0).all()  # descending raises chosen, lowers rejected


def test_kto_is_its_papers_formula():
    label = torch.tensor([True, False, True])
    z0 = kl_estimate(torch.tensor([-3.0, -1.0]), torch.tensor([-4.0, -1.5]))  # mean(1.0, 0.5) = 0.75
    assert float(z0) == pytest.approx(0.75)
    assert float(kl_estimate(torch.tensor([-4.0]), torch.tensor([-3.0]))) == 0.0  # clamped at 0
    b = _inputs(label=label, kl=z0, desirable_weight=1.5, undesirable_weight=0.7)
    losses, chosen, rejected = get_pref_loss("kto").fn(b, beta=BETA)
    r = [PI_C[i] - REF_C[i] for i in range(3)]  # each row's log-ratio (rows ride in the "chosen" slots)
    want = [
        1.5 * (1 - _sig(BETA * (r[0] - 0.75))),
        0.7 * (1 - _sig(BETA * (0.75 - r[1]))),
        1.5 * (1 - _sig(BETA * (r[2] - 0.75))),
    ]
    assert losses.tolist() == pytest.approx(want, rel=1e-12)
    assert chosen[0].item() == pytest.approx(BETA * r[0]) and math.isnan(chosen[1].item())
    assert rejected[1].item() == pytest.approx(BETA * r[1]) and math.isnan(rejected[0].item())


def test_bradley_terry_loss_and_accuracy_by_hand():
    rc, rr = [1.5, -0.2, 0.3, 2.0], [0.5, 0.4, 0.3, -1.0]
    margin = [0.0, 0.5, 0.0, 1.0]
    losses, correct = bradley_terry_loss(
        torch.tensor(rc, dtype=torch.float64), torch.tensor(rr, dtype=torch.float64),
        margin=torch.tensor(margin, dtype=torch.float64), center_coef=0.01,
    )  # fmt: skip
    want = [-_logsig(c - r - m) + 0.01 * (c + r) ** 2 for c, r, m in zip(rc, rr, margin)]
    assert losses.tolist() == pytest.approx(want, rel=1e-12)
    assert correct.tolist() == [1.0, 0.0, 0.0, 1.0]  # a tie is not a correct ranking (TRL: r_c > r_r)


def test_the_registry_names_the_problem():
    with pytest.raises(UserError, match="unknown preference loss pref.loss='sigmod' .did you mean sigmoid"):
        get_pref_loss("sigmod")
    with pytest.raises(UserError, match="already registered"):
        register_pref_loss("sigmoid", needs_ref=True, beta=0.1)(lambda b, **kw: None)
    assert {"sigmoid", "ipo", "hinge", "robust", "simpo", "orpo", "kto"} <= set(PREF_LOSSES)
    assert not get_pref_loss("simpo").needs_ref and not get_pref_loss("kto").paired and get_pref_loss("orpo").nll


# ---------------------------------------------------------------------------------------------
# TRL's own loss code on the same batch (trl is an optional extra: pip install trl)


def _trl():
    return pytest.importorskip("trl", reason="trl is not installed (an optional extra): TRL's losses not compared")


class _Accelerator:
    device = torch.device("cpu")

    def gather(self, t):
        return t

    gather_for_metrics = gather


class _Model:
    """Stands in for the policy under TRL's fused LM head: the per-token log-probs it returns sum to the fixed
    sequence log-probs (spread evenly over each completion's tokens, 0 elsewhere, as TRL's -100 labels give)."""

    training = True

    def __init__(self, log_probs):
        self.log_probs = log_probs

    def __call__(self, **kwargs):
        from types import SimpleNamespace

        lp = self.log_probs
        return SimpleNamespace(
            log_probs=lp, entropy=torch.zeros_like(lp), mean_logits=torch.zeros_like(lp), is_top1=lp != 0
        )


def _trl_dpo(trl, name: str, inp: PrefInputs):
    """TRL 1.16's DPOTrainer._compute_loss (its own code) on our batch: (loss, its logged metrics)."""
    from collections import defaultdict

    lens = torch.cat([inp.chosen_len, inp.rejected_len]).long()
    logps = torch.cat([inp.chosen_logps, inp.rejected_logps])
    width = int(lens.max()) + 1
    completion = torch.zeros(len(lens), width, dtype=torch.long)
    log_probs = torch.zeros(len(lens), width - 1, dtype=torch.float64)
    for row, (n, total) in enumerate(zip(lens.tolist(), logps.tolist())):
        completion[row, width - n :] = 1
        log_probs[row, width - 1 - n :] = total / n
    t = object.__new__(trl.DPOTrainer)
    t.model, t.accelerator, t._metrics = _Model(log_probs), _Accelerator(), defaultdict(lambda: defaultdict(list))
    t.aux_loss_enabled, t.ld_alpha, t.precompute_ref_logps, t.use_weighting = False, None, True, False
    t.f_divergence_type, t.loss_types, t.loss_weights = "reverse_kl", [name], [1.0]
    t.beta, t.label_smoothing, t._total_train_tokens, t._tp_size = BETA, 0.0, 0, 1
    inputs = {
        "input_ids": torch.ones_like(completion),
        "attention_mask": torch.ones_like(completion),
        "completion_mask": completion,
        "ref_chosen_logps": inp.ref_chosen_logps,
        "ref_rejected_logps": inp.ref_rejected_logps,
    }
    loss = trl.DPOTrainer._compute_loss(t, t.model, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in t._metrics["train"].items()}


@pytest.mark.parametrize("name", ["sigmoid", "robust", "hinge", "ipo"])
def test_dpo_losses_and_metrics_equal_trls(name):
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'rlctl[bench]'): not compared to TRL")
    inp = _inputs()
    loss, metrics = _trl_dpo(trl, name, inp)
    losses, chosen, rejected = get_pref_loss(name).fn(inp, beta=BETA)
    assert float(losses.mean()) == pytest.approx(loss, rel=1e-5)
    assert float(chosen.mean()) == pytest.approx(metrics["rewards/chosen"], rel=1e-5)
    assert float(rejected.mean()) == pytest.approx(metrics["rewards/rejected"], rel=1e-5)
    assert float((chosen > rejected).float().mean()) == pytest.approx(metrics["rewards/accuracies"])
    assert float((chosen - rejected).mean()) == pytest.approx(metrics["rewards/margins"], rel=1e-5)
    assert float(inp.chosen_logps.mean()) == pytest.approx(metrics["logps/chosen"], rel=1e-5)


@pytest.mark.parametrize("e", [0.0, 0.1])
def test_simpo_and_orpo_equal_trls(e):
    pytest.importorskip("trl", reason="trl is not installed (pip install 'rlctl[bench]'): not compared to TRL")
    from types import SimpleNamespace

    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    inp = _inputs()
    mc, mr = inp.chosen_logps / inp.chosen_len, inp.rejected_logps / inp.rejected_len  # TRL averages for both
    cpo = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=0.5, beta=BETA, label_smoothing=e)
    cpo.accelerator = _Accelerator()
    theirs = CPOTrainer.cpo_loss(cpo, mc, mr)
    ours = get_pref_loss("simpo").fn(inp, beta=BETA, label_smoothing=e, gamma=0.5)
    for t, o in zip(theirs, ours):
        assert o.tolist() == pytest.approx(t.tolist(), rel=1e-9)
    orpo = SimpleNamespace(beta=BETA, accelerator=_Accelerator())
    theirs = ORPOTrainer.odds_ratio_loss(orpo, mc, mr)
    ours = get_pref_loss("orpo").fn(inp, beta=BETA)
    assert ours[0].tolist() == pytest.approx((-theirs[0]).tolist(), rel=1e-5)  # TRL: loss = nll - mean(these)
    assert ours[1].tolist() == pytest.approx(theirs[1].tolist(), rel=1e-5)
    assert ours[2].tolist() == pytest.approx(theirs[2].tolist(), rel=1e-5)


@pytest.mark.parametrize("coef", [None, 0.01])
def test_bradley_terry_equals_trls_reward_trainer(coef):
    trl = pytest.importorskip("trl", reason="trl is not installed (pip install 'rlctl[bench]'): not compared to TRL")
    from collections import defaultdict
    from types import SimpleNamespace

    rc = torch.tensor([1.5, -0.2, 0.3, 2.0], dtype=torch.float64)
    rr = torch.tensor([0.5, 0.4, 0.3, -1.0], dtype=torch.float64)
    margin = torch.tensor([0.0, 0.5, 0.0, 1.0], dtype=torch.float64)
    scores = torch.cat([rc, rr])[:, None]
    model = SimpleNamespace(training=True)
    t = SimpleNamespace(model=model, accelerator=_Accelerator(), _metrics=defaultdict(lambda: defaultdict(list)))
    t.args, t._total_train_tokens, t._tp_size = SimpleNamespace(center_rewards_coefficient=coef), 0, 1
    inputs = {"attention_mask": torch.ones(8, 3), "margin": margin}
    loss = trl.RewardTrainer.compute_loss(t, lambda **kw: SimpleNamespace(logits=scores), inputs)
    losses, correct = bradley_terry_loss(rc, rr, margin=margin, center_coef=coef or 0.0)
    assert float(losses.mean()) == pytest.approx(float(loss), rel=1e-12)
    assert float(correct.mean()) == pytest.approx(t._metrics["train"]["accuracy"][-1])
