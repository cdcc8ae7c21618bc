"""``reward.fn`` is a typed setting like the others: None when not given (each row's data_source picks its
built-in reward), "auto" (the CLI, --set, older config files) reads as None, a named reward is kept."""

from __future__ import annotations

from rlctl.config import build_config, dotted_to_nested, load_config, save_config
from rlctl.presets import method_layers
from rlctl.rewards.spec import rule_specs


def _cfg(**sets):
    return build_config("grpo", method_layers("grpo", None) + [dotted_to_nested(sets)])


def test_reward_fn_is_none_unless_named(tmp_path):
    assert _cfg().reward.fn is None
    assert _cfg(**{"reward.fn": "auto"}).reward.fn is None
    assert _cfg(**{"reward.fn": "gsm8k"}).reward.fn == "gsm8k"
    old = tmp_path / "config.yaml"
    save_config(_cfg(), old)
    old.write_text(old.read_text().replace("fn: null", "fn: auto"))  # a config.yaml written before
    assert "fn: auto" in old.read_text() and load_config(old).reward.fn is None


def test_unset_reward_fn_is_the_data_source_rule():
    assert [s.spec for s in rule_specs(_cfg().reward)] == ["auto"]
    assert rule_specs(_cfg(**{"reward.model": "org/rm"}).reward) == []  # a reward model alone
    assert [s.spec for s in rule_specs(_cfg(**{"reward.model": "org/rm", "reward.fn": "gsm8k"}).reward)] == ["gsm8k"]
