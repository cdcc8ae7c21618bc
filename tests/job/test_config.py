"""The typed configuration: layering, validation and errors."""

from __future__ import annotations

import pytest

from rlctl.config import RunConfig, all_config_keys, build_config, load_config, parse_set_options, save_config
from rlctl.errors import UserError
from rlctl.presets import method_layers


def test_precedence_preset_file_options_set():
    preset = {"train": {"lr": 1.0, "batch_size": 8, "max_len": 100, "seed": 1}}
    file_layer = {"train": {"lr": 2.0, "batch_size": 16, "max_len": 200}}
    options = {"train": {"lr": 3.0, "batch_size": 32}}
    sets = parse_set_options(["train.lr=4.0"])
    cfg = build_config("sft", [preset, file_layer, options, sets])
    assert cfg.train.lr == 4.0  # --set wins
    assert cfg.train.batch_size == 32  # options beat the file
    assert cfg.train.max_len == 200  # the file beats the preset
    assert cfg.train.seed == 1  # the preset beats the defaults


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(UserError) as e:
        build_config("sft", [parse_set_options(["train.lrr=1e-5"])])
    assert "unknown config key 'train.lrr'" in str(e.value)
    assert "train.lr" in str(e.value)
    with pytest.raises(UserError, match="rollout"):
        build_config("grpo", [parse_set_options(["rollot.n=4"])])


def test_types_are_checked_and_coerced():
    cfg = build_config(
        "grpo",
        [parse_set_options(["rollout.n=4", "train.lr=2e-6", "data.packing=false", "parallel.offload_params=true"])],
    )
    assert cfg.rollout.n == 4 and isinstance(cfg.rollout.n, int)
    assert cfg.train.lr == 2e-6
    assert cfg.data.packing is False
    assert cfg.parallel.offload_params is True
    with pytest.raises(UserError, match="rollout.n must be an integer"):
        build_config("grpo", [parse_set_options(["rollout.n=four"])])
    with pytest.raises(UserError, match="must be true or false"):
        build_config("sft", [parse_set_options(["data.packing=maybe"])])


def test_choices_and_ranges():
    with pytest.raises(UserError, match="did you mean vllm"):
        build_config("grpo", [parse_set_options(["rollout.engine=vlm"])])
    with pytest.raises(UserError, match="at least 1"):
        build_config("grpo", [parse_set_options(["rollout.n=0"])])
    with pytest.raises(UserError, match="dual_clip must be > 1"):
        build_config("grpo", [parse_set_options(["algo.dual_clip=0.5"])])


def test_set_syntax_errors():
    with pytest.raises(UserError, match="key=value"):
        parse_set_options(["train.lr"])
    with pytest.raises(UserError, match="is a section"):
        build_config("sft", [parse_set_options(["train=3"])])


def test_method_presets_apply_and_round_trip(tmp_path):
    cfg = build_config("grpo", method_layers("grpo", None))
    assert cfg.rollout.n == 8 and cfg.algo.adv == "grpo" and cfg.train.lr == 1e-6
    ppo = build_config("ppo", method_layers("ppo", None))
    assert ppo.algo.adv == "gae" and ppo.algo.kl_in_reward is True
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_every_key_is_reachable_with_set():
    keys = all_config_keys()
    assert "train.lr" in keys and "rollout.n" in keys and "hardware.gpus" in keys
    defaults = RunConfig()
    for key in keys:
        obj = defaults
        for part in key.split("."):
            obj = getattr(obj, part)


def test_tri_states_are_bool_or_none_and_read_the_old_strings(tmp_path):
    """parallel.* tri-states are ``bool | None`` (None: the plan decides); "auto"/"true"/"false" from an
    older YAML file or --set still read, and a resolved config written to disk reads back typed."""
    keys = ("sequence_parallel", "activation_checkpointing", "offload_params", "offload_optimizer")
    keys += ("selective_checkpointing", "offload_activations", "shard")
    assert all(getattr(RunConfig().parallel, k) is None for k in keys)
    old = tmp_path / "old.yaml"
    old.write_text("parallel:\n  shard: 'false'\n  offload_params: auto\n  sequence_parallel: true\n")
    from rlctl.config import load_yaml_file

    sets = parse_set_options(["parallel.offload_optimizer=auto", "parallel.activation_checkpointing=false"])
    sets["parallel"]["selective_checkpointing"] = "TRUE"
    cfg = build_config("grpo", [load_yaml_file(old), sets])
    got = {k: getattr(cfg.parallel, k) for k in keys}
    assert got == {
        "sequence_parallel": True,
        "activation_checkpointing": False,
        "offload_params": None,
        "offload_optimizer": None,
        "selective_checkpointing": True,
        "offload_activations": None,
        "shard": False,
    }
    save_config(cfg, tmp_path / "config.yaml")
    assert "'auto'" not in (tmp_path / "config.yaml").read_text()
    assert load_config(tmp_path / "config.yaml") == cfg
    with pytest.raises(UserError, match=r"parallel.shard must be true, false or auto \(the plan decides\)"):
        build_config("sft", [parse_set_options(["parallel.shard=maybe"])])


# enumerated settings the plan decides: ``Literal | None``, no "auto" among their values
PLAN_DECIDES = {
    "model.dtype": ("bf16", "fp16", "fp32"),
    "model.attn": ("sdpa", "eager", "flash_attention_2"),
    "hardware.device": ("cuda", "cpu"),
    "parallel.backend": ("fsdp", "megatron"),
    "rollout.engine": ("hf", "vllm", "sglang"),
    "data.format": ("chat", "pairs", "rl"),
}
RUN_TIME = {"model.attn"}  # the plan forecasts it; the engine picks on the ranks (the resolved config keeps None)
LOADER = {"data.format"}  # the data loader decides, row by row: no plan decision, None in the resolved config


@pytest.mark.parametrize("key", sorted(PLAN_DECIDES))
def test_an_enumerated_setting_the_plan_decides_is_none_and_reads_the_old_auto(key, tmp_path):
    """None by default (the plan decides); "auto" from a YAML file, --set or a flag still reads as None;
    "auto" is no value of its Literal; the plan decides one of its values, which the resolved config holds
    (data.format: the loader decides, row by row)."""
    from rlctl.config import CHOICES, get_key, load_yaml_file
    from rlctl.job import resolve_job

    section, name = key.split(".")
    assert get_key(RunConfig(), key) is None and CHOICES[key] == PLAN_DECIDES[key]
    old = tmp_path / "old.yaml"
    old.write_text(f"{section}:\n  {name}: auto\n")
    for layer in (load_yaml_file(old), parse_set_options([f"{key}=auto"]), parse_set_options([f"{key}=AUTO"])):
        assert get_key(build_config("sft", [layer]), key) is None
    given = PLAN_DECIDES[key][-1]
    assert get_key(build_config("sft", [parse_set_options([f"{key}={given}"])]), key) == given
    with pytest.raises(UserError, match=rf"{key}='nope' is not valid; choose one of {', '.join(PLAN_DECIDES[key])}"):
        build_config("sft", [parse_set_options([f"{key}=nope"])])
    method = "grpo" if key.startswith("rollout.") else "sft"
    job = resolve_job(method, options={"model.name": "Qwen/Qwen2.5-0.5B", "hardware.device": "cpu", key: "auto"})
    if key in LOADER:
        assert get_key(job.cfg, key) is None and key not in [d.key for d in job.plan.decisions]
        return
    assert job.plan.decided(key) in PLAN_DECIDES[key]  # the plan's choice, in its words too
    assert get_key(job.cfg, key) == (None if key in RUN_TIME else job.plan.decided(key))


def test_choices_come_from_the_names_module():
    """CHOICES is read off the schema's Literal types: every enumerated key, each value once, and a
    value outside its Literal is refused with a did-you-mean, whichever layer sets it."""
    import typing

    from rlctl import names
    from rlctl.config import CHOICES

    literals = {v for v in vars(names).values() if typing.get_origin(v) is typing.Literal}
    assert {typing.get_args(v) for v in literals} >= set(CHOICES.values())
    assert CHOICES["rollout.engine"] == ("hf", "vllm", "sglang")
    assert CHOICES["algo.loss_agg"] == names.choices(names.LossAgg)  # LossAgg | None
    assert "parallel.shard" not in CHOICES and "model.name" not in CHOICES
    with pytest.raises(UserError, match=r"rollout.engine='vlm' is not valid \(did you mean vllm\?\)"):
        build_config("grpo", [{"rollout": {"engine": "vlm"}}])
    with pytest.raises(UserError, match="train.precision='fp8' is not valid.*choose one of mixed, bf16"):
        build_config("sft", [parse_set_options(["train.precision=fp8"])])
    assert (
        names.describe(names.Precision)
        == "mixed (fp32 master weights, grads, AdamW: 16 bytes/param) | bf16 (pure bf16: 8 bytes/param)"
    )
    assert names.describe(names.Backend) == "fsdp | megatron"


def test_rollout_engines_and_algorithm_names_match_their_implementations():
    from rlctl import names
    from rlctl.algos import AGG_MODES, KL_KINDS
    from rlctl.algos.kl import KL_ALIASES
    from rlctl.rollout.base import _ENGINE_CLASSES

    assert tuple(_ENGINE_CLASSES) == names.ROLLOUT_ENGINES == ("hf", "vllm", "sglang")
    assert AGG_MODES == names.choices(names.LossAgg)
    assert set(KL_ALIASES) < set(KL_KINDS) == set(names.choices(names.KlKind))
