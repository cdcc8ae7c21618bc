"""The registries as extension points: a name registered twice is refused; a plugin file (``--plugin``,
``plugins:``) registers a policy loss the config accepts, imported once per process, its errors one line;
and a GRPO run through the CLI trains with a loss from a user's file on both ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rlctl.algos.losses import PolicyLossContext
from rlctl.algos.registry import ADV_ESTIMATORS, POLICY_LOSSES, register_adv_est, register_policy_loss
from rlctl.config import build_config
from rlctl.errors import UserError
from tests.support.cli import run_cli
from tests.support.rl import arith_rows, rl_args
from tests.support.sft import write_jsonl

# A user's file: a policy loss that is PPO's times zero (no gradient, so an update leaves the weights as
# they were), marking every rank it ran on.
ZERO_PG = """
import os
from pathlib import Path

from rlctl.algos.losses import ppo_policy_loss
from rlctl.algos.registry import register_policy_loss


@register_policy_loss("{name}", clip_low=0.2, clip_high=0.2, dual_clip=None, agg="seq-mean-token-sum")
def zero_pg(ctx):
    loss, metrics = ppo_policy_loss(ctx)
    marks = os.environ.get("ZERO_PG_MARKS")
    if marks:
        Path(marks, "rank" + os.environ.get("RANK", "0")).touch()
    return loss * 0.0, metrics
"""


@pytest.fixture
def plugin_file(tmp_path, request):
    """A plugin file registering a policy loss named after the test; unregistered afterwards."""
    name = f"zero_pg_{request.node.name}"
    path = tmp_path / "my_loss.py"
    path.write_text(ZERO_PG.format(name=name))
    yield path, name
    POLICY_LOSSES.pop(name, None)
    for module in [m for m in sys.modules if m.startswith("rlctl_plugin_my_loss_")]:
        del sys.modules[module]


def test_a_name_registered_twice_is_refused():
    with pytest.raises(UserError, match=r"algo.policy_loss 'ppo' is already registered \(rlctl.algos.losses:ppo"):
        register_policy_loss("ppo", clip_low=0.1, clip_high=0.1, dual_clip=None, agg="token-mean")(lambda *a: a)
    with pytest.raises(UserError, match=r"algo.adv 'gae' is already registered \(rlctl.algos.estimators:gae_adv"):
        register_adv_est("gae", needs_critic=True)(lambda *a: a)
    with pytest.raises(UserError, match="agg='token-sum' is not valid"):
        register_policy_loss("x", clip_low=0.1, clip_high=0.1, dual_clip=None, agg="token-sum")
    assert POLICY_LOSSES["ppo"].target == "rlctl.algos.losses:ppo_policy_loss"  # the first one stays
    assert ADV_ESTIMATORS["gae"].needs_critic


def test_a_plugin_file_registers_a_loss_the_config_accepts(plugin_file, tmp_path, monkeypatch):
    path, name = plugin_file
    with pytest.raises(UserError, match=rf"algo.policy_loss='{name}' is not valid.*a plugin can register more"):
        build_config("grpo", [{"algo": {"policy_loss": name}}])
    monkeypatch.chdir(tmp_path)
    cfg = build_config("grpo", [{"plugins": ["my_loss.py"], "algo": {"policy_loss": name}}])
    assert cfg.plugins == [str(path)]  # made absolute: the ranks import the same file
    from rlctl.algos.losses import ppo_policy_loss
    from rlctl.algos.registry import resolve_policy_loss

    loss = resolve_policy_loss(name, clip_low=None, clip_high=None, dual_clip=None, agg=None)
    assert (loss.clip_low, loss.dual_clip, loss.agg) == (0.2, None, "seq-mean-token-sum")
    logp, old, adv, mask = (
        torch.tensor([[-1.0, -2.0]]),
        torch.tensor([[-1.5, -2.0]]),
        torch.ones(1, 2),
        torch.ones(1, 2),
    )
    ctx = PolicyLossContext(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip=None, agg="token-mean")
    got, metrics = loss.loss.fn(ctx)
    _, want = ppo_policy_loss(ctx)
    assert got.item() == 0.0 and metrics.keys() == want.keys()
    # a second config in the same process (the CLI and then the planner, a rank loading config.yaml)
    # imports the file once: no "registered twice"
    again = build_config("grpo", [{"plugins": [str(path)], "algo": {"policy_loss": name}}])
    assert again.algo.policy_loss == name


# a batch of 2 sequences: 3 valid tokens of 4, advantages per sequence
LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
OLD = torch.tensor([[-1.5, -2.0], [-0.5, -2.0]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[1, 1], [1, 0]])


def _registered(name, fn):
    register_policy_loss(name, clip_low=0.1, clip_high=0.3, dual_clip=None, agg="token-mean")(fn)
    return POLICY_LOSSES.pop(name)  # the entry, as the recipe gets it; the name freed again


def test_a_plugin_in_the_older_keyword_form_is_adapted():
    """docs/plugins.md's vanilla_pg as it was written before the context: four tensors, keyword settings."""
    seen = []

    def vanilla_pg(logp, old_logp, advantages, mask, *, clip_low, clip_high, dual_clip, agg, **denoms):
        seen.append({"clip_low": clip_low, "clip_high": clip_high, "dual_clip": dual_clip, "agg": agg, **denoms})
        from rlctl.algos.losses import aggregate

        loss = aggregate(-advantages.unsqueeze(-1) * logp, mask, agg, **denoms)
        return loss, {"clip_frac": loss.detach() * 0, "approx_kl": loss.detach() * 0}

    entry = _registered("test_old_vanilla_pg", vanilla_pg)
    assert entry.style == "keywords"
    ctx = PolicyLossContext(LOGP, OLD, ADV, MASK, clip_low=0.1, clip_high=0.3, agg="token-mean", global_tokens=6)
    loss, _ = entry.fn(ctx)
    by_hand = -(1.0 * -1.0 + 1.0 * -2.0 + -2.0 * -0.5) / 6  # -sum(A * logp) over the valid tokens / 6
    assert loss.item() == pytest.approx(by_hand)
    # it receives the keywords the recipe passed before: is_weights only when rollout correction is on
    assert seen[0] == {
        "clip_low": 0.1,
        "clip_high": 0.3,
        "dual_clip": None,
        "agg": "token-mean",
        "global_tokens": 6,
        "global_seqs": None,
        "norm_len": None,
    }


def test_a_plugin_taking_the_context_gets_it_with_its_own_knobs():
    def scaled_pg(ctx, *, scale=2.0):
        per_token = -ctx.advantages.unsqueeze(-1) * ctx.logp * scale
        return ctx.reduce(per_token), {"clip_frac": ctx.approx_kl() * 0, "approx_kl": ctx.approx_kl()}

    entry = _registered("test_scaled_pg", scaled_pg)
    assert entry.style == "context" and entry.fn is scaled_pg
    loss, m = entry.fn(PolicyLossContext(LOGP, OLD, ADV, MASK), scale=3.0)
    assert loss.item() == pytest.approx(-3.0 * (1.0 * -1.0 + 1.0 * -2.0 + -2.0 * -0.5) / 3)
    assert m["approx_kl"].item() == pytest.approx((-0.5 + 0.0 + 0.0) / 3)  # mean(old - logp), valid tokens


def test_a_plugin_of_neither_form_is_refused_in_one_line():
    def two(logp, old_logp):
        return logp, {}

    with pytest.raises(UserError) as e:
        register_policy_loss("test_two", clip_low=0.1, clip_high=0.1, dual_clip=None, agg="token-mean")(two)
    assert "\n" not in str(e.value)
    assert "policy loss 'test_two'" in str(e.value) and "takes 2 positional parameter(s) (logp, old_logp)" in str(
        e.value
    )
    assert "write it as fn(ctx)" in str(e.value) and "test_two" not in POLICY_LOSSES


def test_a_plugin_module_registers_an_estimator_with_its_facts(tmp_path, monkeypatch):
    """A module name on sys.path works like a file; the estimator's facts drive the algorithm check."""
    from rlctl.config.algorithm import check_algorithm

    (tmp_path / "my_adv_plugin.py").write_text(
        "from rlctl.algos.registry import register_adv_est\n"
        "@register_adv_est('my_group_adv', needs_groups=True)\n"
        "def my_group_adv(rewards, mask, *, n, **_):\n"
        "    return rewards, rewards\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cfg = build_config("grpo", [{"plugins": "my_adv_plugin", "algo": {"adv": "my_group_adv"}}])
        assert cfg.plugins == ["my_adv_plugin"] and ADV_ESTIMATORS["my_group_adv"].fn.__name__ == "my_group_adv"
        check_algorithm(cfg)
        cfg.rollout.n = 1
        with pytest.raises(UserError, match="--adv my_group_adv compares the samples of a prompt"):
            check_algorithm(cfg)
        with pytest.raises(UserError, match="rlctl ppo trains a critic .* or --adv gae$"):
            check_algorithm(build_config("ppo", [{"plugins": ["my_adv_plugin"], "algo": {"adv": "my_group_adv"}}]))
    finally:
        ADV_ESTIMATORS.pop("my_group_adv", None)
        sys.modules.pop("my_adv_plugin", None)


@pytest.mark.parametrize(
    ("source", "plugin", "message"),
    [
        (None, "missing.py", r"plugin file not found: missing.py \(a plugin is a .py file or an importable module"),
        (None, "no_such_plugin_module", r"plugin module 'no_such_plugin_module' not found"),
        (
            "x = 1\ny = undefined_name\n",
            "bad.py",
            r"bad.py failed to import: NameError: name 'undefined_name' is not defined \(bad.py line 2\)",
        ),
        ("def f(:\n", "bad.py", r"bad.py failed to import: SyntaxError: .* \(bad.py line 1\)"),
        (
            "from rlctl.algos.registry import register_adv_est\nregister_adv_est('grpo')(print)\n",
            "bad.py",
            r"bad.py failed to import: algo.adv 'grpo' is already registered "
            r"\(rlctl.algos.estimators:grpo_advantages\)",
        ),
    ],
)
def test_a_broken_plugin_is_one_line(tmp_path, monkeypatch, source, plugin, message):
    monkeypatch.chdir(tmp_path)
    if source is not None:
        (tmp_path / plugin).write_text(source)
    with pytest.raises(UserError, match=message) as e:
        build_config("grpo", [{"plugins": [plugin]}])
    assert "\n" not in str(e.value)
    assert not [m for m in sys.modules if m.startswith("rlctl_plugin_bad_")]  # a later fixed file is imported


@pytest.mark.slow
def test_grpo_trains_with_a_policy_loss_from_a_user_file(plugin_file, tiny_model_dir, tmp_path):
    """`rlctl grpo --plugin my_loss.py --set algo.policy_loss=NAME` end to end on 2 CPU processes: the
    config accepts the name, both ranks import the file and call the loss, and the loss is the one that
    trained: PPO's loss times zero leaves every weight exactly as it was (no KL loss: --kl-coef 0)."""
    path, name = plugin_file
    data = write_jsonl(tmp_path / "rl.jsonl", arith_rows(16))
    marks, run = tmp_path / "marks", tmp_path / "run"
    marks.mkdir()
    extra = ["--plugin", path.name, "--set", f"algo.policy_loss={name}", "--kl-coef", "0", "--max-steps", "2"]
    res = run_cli(
        "grpo",
        *rl_args(tiny_model_dir, data, run, "--rollout", "hf", *extra),
        cwd=tmp_path,
        env={"ZERO_PG_MARKS": str(marks)},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == ["rank0", "rank1"]
    import yaml

    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["plugins"] == [str(path)] and resolved["algo"]["policy_loss"] == name
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if "pg/loss" in s]
    assert len(steps) == 2 and all(s["pg/loss"] == 0.0 for s in steps)
    from safetensors.torch import load_file

    before = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    after = load_file(str(next((run / "hf").glob("*.safetensors"))))
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k].to(after[k].dtype), after[k])]
    assert not changed, f"a zero loss changed {changed}"
