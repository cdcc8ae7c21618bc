"""One table of flags for `rlctl sft|grpo|ppo` and `rlctl estimate memory`, one path through job.resolve_job:
the same flags give the estimate of `estimate memory` and of a dry run; the planner's flags reach the
resolved config of a training command; a flag's type is its config key's."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rlctl.errors import UserError


def _invoke(*args: str):
    from rlctl.cli.app import app

    return CliRunner().invoke(app, list(args))


PLANNING = ["--model", "Qwen2.5-7B", "--gpus", "8", "--gpu", "H100-80GB", "--lora-rank", "16", "--n", "4"]


@pytest.mark.parametrize("extra", [[], ["--offload-optimizer", "--no-gradient-checkpointing", "--rollout", "vllm"]])
def test_estimate_memory_and_a_dry_run_give_the_same_plan(extra):
    est = _invoke("estimate", "memory", "--method", "grpo", *PLANNING, *extra, "--json")
    dry = _invoke("grpo", *PLANNING, *extra, "--dry-run", "--json")
    assert est.exit_code == 0 and dry.exit_code == 0, (est.output, dry.output)
    est, dry = json.loads(est.output), json.loads(dry.output)
    assert est["plan"] == {k: v for k, v in dry["plan"].items() if k != "estimate"}
    assert est["peak_bytes"] == dry["estimate"]["peak_bytes"] > 0
    if extra:
        assert dry["config"]["parallel"]["offload_optimizer"] in (True, "true")
        assert dry["config"]["parallel"]["activation_checkpointing"] in (False, "false")
        assert dry["plan"]["rollout"] == "vllm" and est["settings"]["offload_optimizer"] is True


def test_the_planners_flags_reach_a_training_commands_config(tmp_path):
    r = _invoke(
        "sft",
        *("--model", "Qwen2.5-7B", "--gpus", "8", "--dry-run", "--json"),
        *("--offload-params", "--no-offload-optimizer", "--precision", "bf16", "--max-tokens-per-micro-batch", "4096"),
        *("--backend", "fsdp", "--host-memory", "512", "--dtype", "bf16"),
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    par, cfg = doc["config"]["parallel"], doc["config"]
    assert par["offload_params"] in (True, "true") and par["offload_optimizer"] in (False, "false")
    assert (par["backend"], cfg["train"]["precision"], cfg["model"]["dtype"]) == ("fsdp", "bf16", "bf16")
    assert cfg["train"]["max_tokens_per_micro_batch"] == 4096 and cfg["hardware"]["host_memory_gib"] == 512.0
    assert doc["plan"]["offload_params"] is True and doc["estimate"]["host_memory_bytes"] == 512 * 2**30


def test_estimate_memory_takes_the_configuration_layers(tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text("method: sft\ntrain:\n  max_len: 1024\nlora:\n  rank: 8\n")
    args = ("estimate", "memory", "--model", "Qwen2.5-7B", "--method", "sft", "--gpus", "1", "--json")
    r = _invoke(*args, "--config", str(run), "--set", "lora.rank=4")
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)["settings"]
    assert (s["max_len"], s["lora_rank"]) == (1024, 4)
    wrong = _invoke(*args[:4], "--method", "grpo", "--config", str(run))
    assert isinstance(wrong.exception, UserError) and "`rlctl sft`" in str(wrong.exception)


def test_a_flags_type_is_its_config_keys():
    from rlctl.cli.flags import FLAGS
    from rlctl.cli.options import key_type, option_type

    assert key_type("train.lr") is float and key_type("rollout.n") is int and key_type("algo.clip_low") is float
    for flag in FLAGS:
        if flag.key and not flag.switch:
            assert option_type(flag) == key_type(flag.key) | None, flag.name
        if flag.switch:
            assert option_type(flag) == bool | None, flag.name


def test_every_flag_has_one_row_and_every_command_its_flags_once():
    from rlctl.cli.flags import ALL, FLAGS
    from rlctl.cli.options import flags_of

    names = [f.name for f in FLAGS]
    assert len(names) == len(set(names))
    for command in ALL:
        decls = [d.split("/")[0] for f in flags_of(command) for d in f.names()]
        assert len(decls) == len(set(decls)), command
    for f in FLAGS:
        if f.alias_of:
            (target,) = [g for g in FLAGS if g.name == f.alias_of]
            assert f.on <= target.on and not f.key


def test_an_old_flag_name_agrees_with_the_new_one_or_is_one_line():
    r = _invoke("estimate", "memory", "--model", "Qwen2.5-7B", "--gpus", "1", "--json", "--activation-checkpointing")
    assert r.exit_code == 0 and json.loads(r.output)["settings"]["activation_checkpointing"] is True
    r = _invoke(
        "estimate", "memory", "--model", "Qwen2.5-7B", "--gradient-checkpointing", "--no-activation-checkpointing"
    )
    assert isinstance(r.exception, UserError) and "\n" not in str(r.exception)
    assert "--activation-checkpointing is the old name of --gradient-checkpointing" in str(r.exception)


@pytest.mark.parametrize("flag, want", [("--offload-params", True), ("--no-offload-params", False), (None, None)])
def test_the_walk_of_offload_params_from_the_flag_to_the_engine_spec(flag, want):
    """docs/architecture.md's walk: the flag -> the options layer -> the plan -> the resolved config -> the
    engine's spec (what FSDPEngine reads); left out, the plan decides and the spec gets the plan's choice."""
    from rlctl.cli.options import to_options
    from rlctl.engines.spec import EngineSpec
    from rlctl.job import resolve_job

    values = {"offload_params": {"--offload-params": True, "--no-offload-params": False}.get(flag)}
    options = to_options(values, "grpo")
    assert options == ({} if flag is None else {"parallel.offload_params": want})
    opts = {**options, "model.name": "Qwen2.5-7B", "hardware.gpus": 8, "hardware.gpu": "H100-80GB"}
    job = resolve_job("grpo", options=opts)
    assert job.requested.parallel.offload_params is want
    assert isinstance(job.plan.offload_params, bool) and job.cfg.parallel.offload_params is job.plan.offload_params
    if flag is not None:
        assert job.plan.offload_params is want
    assert EngineSpec.from_config(job.cfg).offload_params is job.plan.offload_params
    with pytest.raises(Exception, match="the plan was not applied"):
        EngineSpec.from_config(job.requested)  # the config before the plan: refused, never guessed


def test_estimate_memory_without_a_model_is_one_line():
    r = _invoke("estimate", "memory", "--method", "sft", "--gpus", "1")
    assert isinstance(r.exception, UserError) and "\n" not in str(r.exception)
    assert str(r.exception).startswith("no model given") and "--method sft" in str(r.exception)
