"""One set of flag names on sft / grpo / ppo, each reaching its config key; defaults in --help; the
preset texts agree with the presets; config files with interpolation."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli
from tests.support.sft import chat_rows, write_jsonl

COMMON = [
    ("--val-data", "VAL", "data.val_path"),
    ("--val-fraction", "0.1", "data.val_fraction"),
    ("--eval-every", "5", "train.eval_every"),
    ("--warmup-ratio", "0.1", "train.warmup_ratio"),
    ("--weight-decay", "0.01", "train.weight_decay"),
    ("--lora-rank", "8", "lora.rank"),
    ("--lora-targets", "q_proj,v_proj", "lora.targets"),
    ("--lora-dropout", "0.05", "lora.dropout"),
    ("--run-name", "my-run", "log.run_name"),
    ("--system-prompt", "Be brief.", "data.system_prompt"),
    ("--chat-template", "VAL", "data.chat_template"),
    ("--save-every", "7", "checkpoint.save_every"),
]
RL = [
    ("--top-p", "0.9", "rollout.top_p"),
    ("--top-k", "50", "rollout.top_k"),
    ("--eval-n", "4", "rollout.val_n"),
    ("--entropy-coef", "0.001", "algo.entropy_coef"),
    ("--samples-every", "3", "log.samples_every"),
    ("--max-prompt-len", "256", "rollout.max_prompt_len"),
    ("--max-response-len", "128", "rollout.max_response_len"),
    ("--micro-batch-size", "2", "train.micro_batch_size"),
    ("--overlong-buffer", "32", "algo.overlong_buffer"),
]


def _dry_run(method: str, tmp_path, *args: str) -> dict:
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    r = run_cli(
        method, "--model", "Qwen2.5-0.5B", "--data", str(data), "--dry-run", "--json", "-o", str(tmp_path / "r"), *args
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["config"]


def _get(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


@pytest.mark.parametrize("method", ["sft", "grpo", "ppo"])
def test_every_flag_reaches_its_config_key(method, tmp_path):
    flags = (
        COMMON
        + (RL if method != "sft" else [])
        + ([("--critic-lr", "3e-6", "algo.critic_lr")] if method == "ppo" else [])
    )
    args = [a for flag, value, _ in flags for a in (flag, value.replace("VAL", str(tmp_path / "d.jsonl")))]
    cfg = _dry_run(method, tmp_path, *args, "--lr-scheduler", "constant", "--gradient-checkpointing")
    for flag, value, key in flags:
        want = str(tmp_path / "d.jsonl") if value == "VAL" else value
        got = _get(cfg, key)
        assert (got == type(got)(want)) if not isinstance(got, str) else got == want, (flag, got)
    assert cfg["train"]["lr_scheduler"] == "constant" and cfg["train"]["min_lr_ratio"] == 1.0
    assert cfg["parallel"]["activation_checkpointing"] in ("true", True)


def test_dapo_switches_reach_the_config_and_win_over_the_preset(tmp_path):
    """DAPO's settings without a preset (ppo, with a critic, too) and against the dapo preset's."""
    cfg = _dry_run("ppo", tmp_path, "--n", "4", "--dynamic-sampling", "--overlong-filter")
    assert cfg["algo"]["dynamic_sampling"] is True and cfg["algo"]["overlong_filter"] is True
    args = ("--preset", "dapo", "--no-dynamic-sampling", "--overlong-filter", "--overlong-buffer", "100")
    cfg = _dry_run("grpo", tmp_path, *args, "--max-response-len", "512")
    assert cfg["algo"]["dynamic_sampling"] is False and cfg["algo"]["overlong_filter"] is True
    assert cfg["algo"]["overlong_buffer"] == 100 and cfg["algo"]["clip_high"] == 0.28  # the rest: the preset's


def test_help_shows_each_methods_defaults():
    from rlctl.config import build_config
    from rlctl.presets import method_layers

    for method in ("sft", "grpo", "ppo"):
        cfg = build_config(method, method_layers(method, None))
        r = run_cli(method, "--help-all", env={"COLUMNS": "250"})
        assert r.returncode == 0
        text = " ".join(r.stdout.split())
        assert f"Peak learning rate. (default: {cfg.train.lr})" in text, method
        assert f"(default: {cfg.train.batch_size})" in text and "(default: -1: auto)" in text
        if method != "sft":
            assert (
                f"(default: {cfg.algo.kl_coef})" in text and f"Samples per prompt. (default: {cfg.rollout.n})" in text
            )


def test_a_bad_key_points_to_the_methods_preset(tmp_path):
    for method in ("grpo", "ppo"):
        r = run_cli(method, "--model", "Qwen2.5-0.5B", "--set", "algo.kl_coeff=0.1", "--dry-run")
        assert r.returncode == 2
        assert "did you mean algo.kl_coef" in r.stderr and f"`rlctl presets show {method}`" in r.stderr, r.stderr


def test_preset_descriptions_agree_with_their_settings():
    from rlctl.presets import load_preset

    grpo = load_preset("grpo")
    assert grpo["config"]["algo"]["kl_coef"] == 0.001
    assert "KL off" not in grpo["description"] and "0.001" in grpo["description"]


def test_save_every_auto_checkpoints_long_runs_only():
    from rlctl.config import build_config, save_every_steps

    assert build_config("grpo", []).checkpoint.save_every == -1
    assert save_every_steps(-1, 20) == 50  # a short run: only the final checkpoint
    assert save_every_steps(-1, 1000) == 100 and save_every_steps(-1, 501) == 51
    assert save_every_steps(0, 1000) == 0 and save_every_steps(7, 1000) == 7


def test_config_file_interpolation_and_its_one_line_error(tmp_path):
    good = tmp_path / "run.yaml"
    good.write_text("train:\n  lr: 3.0e-6\nalgo:\n  critic_lr: ${train.lr}\nlog:\n  run_name: ${oc.env:RUN_TAG,x}-a\n")
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    r = run_cli(
        "ppo",
        "--model",
        "Qwen2.5-0.5B",
        "--data",
        str(data),
        "-c",
        str(good),
        "--dry-run",
        "--json",
        env={"RUN_TAG": "nightly"},
    )
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)["config"]
    assert cfg["algo"]["critic_lr"] == 3e-6 and cfg["log"]["run_name"] == "nightly-a"
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  critic_lr: ${train.nope}\n")
    r = run_cli("ppo", "--model", "Qwen2.5-0.5B", "-c", str(bad), "--dry-run")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "cannot resolve an interpolation" in r.stderr


def test_bad_sampling_values_are_one_line(tmp_path):
    for args, needle in [
        (["--top-p", "0"], "rollout.top_p"),
        (["--top-k", "0"], "rollout.top_k"),
        (["--eval-n", "0"], "rollout.val_n"),
    ]:
        r = run_cli("grpo", "--model", "Qwen2.5-0.5B", "--dry-run", *args)
        assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_ignore_logprob_check_reaches_the_ranks_config(tmp_path):
    assert _dry_run("grpo", tmp_path)["rollout"]["ignore_logprob_check"] is False
    assert _dry_run("grpo", tmp_path, "--ignore-logprob-check")["rollout"]["ignore_logprob_check"] is True


def test_rollout_gpus_and_procs_set_the_same_split(tmp_path):
    """--rollout-procs (CPU) and --rollout-gpus (GPU) are one setting, rollout.procs (docs/offpolicy.md)."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    a = _dry_run("grpo", tmp_path / "a", "--device", "cpu", "--nproc", "2", "--rollout-procs", "1")["rollout"]
    b = _dry_run(
        "grpo", tmp_path / "b", "--device", "cpu", "--nproc", "2", "--rollout-gpus", "1", "--max-staleness", "0"
    )
    assert (a["procs"], a["max_staleness"]) == (1, 1)
    assert (b["rollout"]["procs"], b["rollout"]["max_staleness"]) == (1, 0)
