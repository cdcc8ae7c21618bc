"""The CLI as a user meets it: help, dry runs, one-line errors, completions."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.cli import REPO, run_cli


def test_help_imports_nothing_heavy():
    probe = (
        "import sys; from typer.testing import CliRunner; from rlctl.cli.app import app; "
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
        "r = CliRunner().invoke(app, ['grpo', '--help']); assert r.exit_code == 0, r.output; "
        "heavy = ('torch', 'transformers', 'vllm', 'datasets', 'peft', 'safetensors'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_command_help_has_examples():
    for args in (["sft"], ["grpo"], ["ppo"], ["estimate", "memory"], ["convert"], ["bench"], ["presets"], []):
        r = run_cli(*args, "--help")
        assert r.returncode == 0, r.stderr
        assert "Examples" in r.stdout, args


def test_version_and_python_dash_m():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("rlctl ")


def test_grpo_dry_run_json_for_a_cluster(tmp_path):
    r = run_cli("grpo", "--model", "Qwen2.5-7B", "--gpus", "8", "--dry-run", "--json", "-o", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    plan = doc["plan"]
    assert plan["backend"] == "fsdp" and plan["tp"] == 1 and plan["pp"] == 1 and plan["dp"] == 8
    assert plan["rollout"] in ("sglang", "vllm") and plan["rollout_tp"] >= 1
    assert isinstance(plan["reasons"], list) and all(isinstance(x, str) for x in plan["reasons"])
    assert doc["config"]["method"] == "grpo" and doc["config"]["model"]["name"] == "Qwen2.5-7B"
    assert doc["config"]["parallel"]["backend"] == "fsdp"  # the plan filled the open (None) fields
    launch = doc["launch"]
    assert "torch.distributed.run" in launch and "rlctl.recipes.grpo" in launch
    assert launch[launch.index("--nproc-per-node") + 1] == "8"
    est = doc["estimate"]
    assert est["params"] == 7_615_616_512 and est["fits"] in (True, False) and est["peak_bytes"] > 0
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_dry_run_precedence_and_set(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("rollout:\n  n: 4\ntrain:\n  lr: 3.0e-6\n")
    r = run_cli(
        "grpo",
        "--model",
        "Qwen2.5-1.5B",
        "--gpus",
        "2",
        "--config",
        str(cfg),
        "--n",
        "6",
        "--set",
        "train.lr=5e-6",
        "--dry-run",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    c = json.loads(r.stdout)["config"]
    assert c["rollout"]["n"] == 6 and c["train"]["lr"] == 5e-6


@pytest.mark.parametrize(
    "args, needle",
    [
        (["grpo", "--model", "Qwen9-7B", "--gpus", "8", "--dry-run"], "unknown model"),
        (["grpo", "--model", "Qwen2.5-7B", "--gpus", "8", "--gpu", "H1000", "--dry-run"], "unknown GPU"),
        (["grpo", "--model", "Qwen2.5-7B", "--gpus", "8", "--set", "train.lrr=1", "--dry-run"], "did you mean"),
        (["grpo", "--model", "Qwen2.5-7B", "--gpus", "8", "--set", "rollout.n=x", "--dry-run"], "must be an integer"),
        (
            [
                "sft",
                "--model",
                "Qwen2.5-7B",
                "--gpus",
                "8",
                "--set",
                "parallel.backend=megatron",
                "--set",
                "parallel.tp=3",
                "--dry-run",
            ],
            "heads",
        ),
        (
            [
                "sft",
                "--model",
                "Qwen2.5-7B",
                "--gpus",
                "6",
                "--set",
                "parallel.backend=megatron",
                "--set",
                "parallel.tp=4",
                "--dry-run",
            ],
            "cannot be split",
        ),
        (
            ["sft", "--model", "Qwen2.5-7B", "--gpus", "8", "--set", "parallel.tp=2", "--dry-run"],
            "needs parallel.backend=megatron",
        ),
        (
            ["sft", "--model", "Qwen2.5-7B", "--gpus", "8", "--nproc", "16", "--dry-run"],
            "more than the 8 GPUs per node",
        ),
        (["sft", "--model", "Qwen2.5-7B", "--config", "/nonexistent.yaml", "--dry-run"], "config file not found"),
        (["grpo", "--gpus", "8", "--dry-run"], "no model given"),
        (["grpo", "--model", "Qwen2.5-7B", "--preset", "grp", "--dry-run"], "unknown preset"),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert needle.lower() in lines[0].lower()
    assert "Traceback" not in r.stderr


def test_presets_list_and_show():
    r = run_cli("presets", "list")
    assert r.returncode == 0 and "grpo" in r.stdout and "tiers" in r.stdout
    r = run_cli("presets", "show", "grpo")
    assert r.returncode == 0 and "rollout" in r.stdout and "kl_coef" in r.stdout


def test_completions_are_up_to_date():
    from rlctl.cli.completions import generate

    for name, text in generate().items():
        path = REPO / "completions" / name
        assert path.is_file(), f"{path} missing: run `make completions`"
        assert path.read_text() == text, f"{path} is stale: run `make completions`"


def test_bash_completion_completes_models_and_subcommands():
    script = REPO / "completions" / "rlctl.bash"
    probe = f"""
source {script}
COMP_WORDS=(rlctl gr); COMP_CWORD=1; _rlctl; echo "${{COMPREPLY[@]}}"
COMP_WORDS=(rlctl grpo --model Qwen2.5-7); COMP_CWORD=3; _rlctl; echo "${{COMPREPLY[@]}}"
COMP_WORDS=(rlctl convert fs); COMP_CWORD=2; _rlctl; echo "${{COMPREPLY[@]}}"
COMP_WORDS=(rlctl sft --pres); COMP_CWORD=2; _rlctl; echo "${{COMPREPLY[@]}}"
COMP_WORDS=(rlctl sft --preset g); COMP_CWORD=3; _rlctl; echo "${{COMPREPLY[@]}}"
"""
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "grpo"
    assert "Qwen2.5-72B" in out[1].split() and "Qwen2.5-7B" in out[1].split()
    assert out[2] == "fsdp-to-hf"
    assert out[3] == "--preset"
    assert "grpo" in out[4].split()
