"""Mistakes a user makes before a job starts (issue 24): each ends in ONE line naming the problem and the
fix, exit 2, before launch, and no run directory, checkpoint or input changes. The CLI runs in this
process (``rlctl.cli.app.main``: the real option parsing, job resolution and checks), so a case costs
milliseconds; the one finished run they resume is a real 2-step SFT run (torchrun, 1 CPU process).
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.cli import one_line_error, rlctl_in_process
from tests.support.rl import arith_rows
from tests.support.sft import chat_rows, write_jsonl


def rlctl(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    return rlctl_in_process(monkeypatch, capsys, *args)


def tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` with the hash of its bytes (directories as entries too)."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(path.rglob("*"))
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("inputs")
    write_jsonl(d / "chat.jsonl", chat_rows(16))
    write_jsonl(d / "rl.jsonl", arith_rows(16))
    (d / "array.jsonl").write_text('[{"prompt": "1+1", "answer": "2"},\n {"prompt": "2+2", "answer": "4"}]\n')
    return d


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, files, tmp_path_factory) -> Path:
    """A completed 2-step SFT run (its summary says completed, step_000002 exists)."""
    from rlctl.cli.app import main

    out = tmp_path_factory.mktemp("finished") / "run"
    argv = ["rlctl", "sft", "--model", str(tiny_model_dir), "--data", str(files / "chat.jsonl")]
    argv += ["--device", "cpu", "--nproc", "1", "--max-steps", "2", "--batch-size", "4", "-o", str(out)]
    old, sys.argv = sys.argv, argv
    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:
        sys.argv = old
    assert exited.value.code in (0, None), (out / "train.log").read_text()[-3000:]
    assert (out / "summary.json").is_file() and (out / "checkpoints" / "step_000002").is_dir()
    return out


RL = ("--reward", "exact", "--max-prompt-len", "48", "--max-response-len", "12", "--device", "cpu")


def _grpo(model: Path, files: Path, *extra: str) -> list[str]:
    return ["grpo", "--model", str(model), "--data", str(files / "rl.jsonl"), *RL, *extra]


# ---------------------------------------------------------------------------------------------
# 1, 2: a resume this job cannot continue is refused before anything in the run directory changes


def test_resume_by_another_method_is_refused_and_the_run_is_untouched(
    monkeypatch, capsys, tiny_model_dir, files, finished_run
):
    before = tree(finished_run)
    code, text = rlctl(monkeypatch, capsys, *_grpo(tiny_model_dir, files, "-o", str(finished_run), "--resume", "auto"))
    line = one_line_error(code, text)
    assert "rlctl sft" in line and "rlctl grpo" in line and "step_000002" in line, line
    assert tree(finished_run) == before


@pytest.fixture(scope="module")
def wider_model(tmp_path_factory) -> Path:
    from rlctl.testing import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("wider") / "model", seed=1, hidden_size=192)


@pytest.mark.parametrize(
    "what, extra, words",
    [
        ("another model", ("--model", "WIDER"), ("hidden_size 128 vs 192",)),
        ("LoRA", ("--lora-rank", "4"), ("full fine-tuning", "LoRA rank 4", "--lora-rank 0")),
    ],
)
def test_resume_with_an_incompatible_job_names_both_sides_before_launch(
    monkeypatch, capsys, tiny_model_dir, wider_model, files, finished_run, what, extra, words
):
    before = tree(finished_run)
    extra = tuple(str(wider_model) if e == "WIDER" else e for e in extra)
    args = ["sft", "--model", str(tiny_model_dir), "--data", str(files / "chat.jsonl"), "--device", "cpu"]
    code, text = rlctl(monkeypatch, capsys, *args, "-o", str(finished_run), "--resume", "auto", *extra)
    line = one_line_error(code, text)
    assert all(w in line for w in words), (what, line)
    assert tree(finished_run) == before


def test_resume_with_another_engine_is_refused(finished_run):
    """(Megatron needs CUDA, so the CLI cannot plan it here: the check itself, on the job's planned engine.)"""
    from rlctl.checks import check_resume_compatible
    from rlctl.config import load_config
    from rlctl.errors import UserError

    cfg = load_config(finished_run / "config.yaml")
    with pytest.raises(UserError, match=r"fsdp engine, this job plans megatron.*parallel.backend=fsdp"):
        check_resume_compatible(cfg, finished_run / "checkpoints" / "step_000002", "megatron")


def test_a_resume_that_fails_on_the_ranks_leaves_the_finished_run_as_it_was(
    monkeypatch, capsys, tiny_model_dir, files, finished_run, tmp_path
):
    """Compatible on paper, refused after launch (a rank's UserError, e.g. a failing env.reset() or no
    image that decodes): the directory is as it was, every file byte for byte (issue 37: train.log cut
    back, errors/ and what the attempt added removed); the one line on the console says it all."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = tree(run)
    monkeypatch.setenv("RLCTL_TEST_RECIPE", "tests.support.scripts.failing_rank")
    monkeypatch.setenv("FAIL_MODE", "user")
    args = ["sft", "--model", str(tiny_model_dir), "--data", str(files / "chat.jsonl"), "--device", "cpu"]
    code, text = rlctl(monkeypatch, capsys, *args, "--nproc", "2", "-o", str(run), "--resume", "auto")
    assert code == 2, text
    assert tree(run) == before


def test_a_refusal_on_the_ranks_leaves_no_new_run_directory(monkeypatch, capsys, tiny_model_dir, files, tmp_path):
    run = tmp_path / "runs" / "new"
    monkeypatch.setenv("RLCTL_TEST_RECIPE", "tests.support.scripts.failing_rank")
    monkeypatch.setenv("FAIL_MODE", "user")
    args = ["sft", "--model", str(tiny_model_dir), "--data", str(files / "chat.jsonl"), "--device", "cpu"]
    code, text = rlctl(monkeypatch, capsys, *args, "--nproc", "2", "-o", str(run))
    assert code == 2 and "data.answer_field" in text, text
    assert not (tmp_path / "runs").exists()


def test_a_vision_language_model_with_rollout_procs_is_refused_before_launch(
    monkeypatch, capsys, tiny_vl_model_dir, files, tmp_path
):
    """Was refused by the trainer after launch (a run directory left behind); the planner knows it."""
    out = tmp_path / "run"
    args = ["grpo", "--model", str(tiny_vl_model_dir), "--data", str(files / "rl.jsonl"), *RL, "--nproc", "2"]
    for extra in ([], ["--dry-run"]):
        line = one_line_error(*rlctl(monkeypatch, capsys, *args, "--rollout-procs", "1", "-o", str(out), *extra))
        assert "--rollout-procs runs text models only" in line and "drop --rollout-procs" in line, line
        assert not out.exists()


def test_a_vision_language_model_with_agent_tools_is_refused_before_launch(
    monkeypatch, capsys, tiny_vl_model_dir, files, tmp_path
):
    """Was refused on the ranks after launch (rlctl.support.agent_vision, asked there too); the planner
    knows the model is VL from its config."""
    from tests.agents.conftest import TOOLS_FILE

    tools, out = tmp_path / "tools.py", tmp_path / "run"
    tools.write_text(TOOLS_FILE)
    args = ["grpo", "--model", str(tiny_vl_model_dir), "--data", str(files / "rl.jsonl"), *RL, "--tools", str(tools)]
    for extra in ([], ["--dry-run"]):
        line = one_line_error(*rlctl(monkeypatch, capsys, *args, "-o", str(out), *extra))
        assert "multi-turn agent runs (--tools / --env / --interaction) take text models only" in line, line
        assert "drop the agent options" in line and not out.exists(), line


# ---------------------------------------------------------------------------------------------
# 5: file-system errors: one line, exit 2, for every command that writes


@pytest.mark.parametrize("method", ["sft", "grpo", "ppo"])
@pytest.mark.parametrize("where", ["an existing file", "below a file", "an unwritable place"])
def test_an_output_that_cannot_be_written_is_one_line(
    monkeypatch, capsys, tiny_model_dir, files, tmp_path, method, where
):
    (tmp_path / "taken").write_text("mine\n")
    out = {"an existing file": tmp_path / "taken", "below a file": tmp_path / "taken" / "run"}.get(where)
    if out is None:
        out = Path("/sys/rlctl-test-run")  # sysfs: no new directories, for root too
        if sys.platform != "linux" or not Path("/sys/kernel").is_dir():
            pytest.skip("needs Linux's /sys")
    data = files / ("chat.jsonl" if method == "sft" else "rl.jsonl")
    args = [method, "--model", str(tiny_model_dir), "--data", str(data), "-o", str(out)]
    args += ["--device", "cpu"] if method == "sft" else list(RL)
    line = one_line_error(*rlctl(monkeypatch, capsys, *args))
    assert str(out) in line and "--output-dir" in line, line
    assert (tmp_path / "taken").read_text() == "mine\n"


def test_report_and_convert_file_system_errors_are_one_line(monkeypatch, capsys, finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "report.png").unlink(missing_ok=True)
    (run / "report.png").mkdir()  # the plot's path is taken by a directory
    line = one_line_error(*rlctl(monkeypatch, capsys, "report", str(run)))
    assert "report.png" in line, line
    if Path("/sys/kernel").is_dir():
        line = one_line_error(
            *rlctl(monkeypatch, capsys, "convert", "fsdp-to-hf", str(run / "checkpoints"), "/sys/out")
        )
        assert "/sys" in line, line


# ---------------------------------------------------------------------------------------------
# 6, 8: what the pre-launch checks and --dry-run now see


@pytest.fixture(scope="module")
def no_tokenizer(tiny_model_dir, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("notok") / "model"
    d.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, d / name)
    return d


@pytest.mark.parametrize("dry_run", [True, False])
@pytest.mark.parametrize("case", ["missing data", "json array", "no tokenizer", "wandb"])
def test_inputs_are_checked_by_dry_run_and_before_launch(
    monkeypatch, capsys, tiny_model_dir, no_tokenizer, files, tmp_path, case, dry_run
):
    import importlib.util

    if case == "wandb" and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    model = no_tokenizer if case == "no tokenizer" else tiny_model_dir
    data = {"missing data": tmp_path / "missing.jsonl", "json array": files / "array.jsonl"}.get(case)
    args = ["sft", "--model", str(model), "--data", str(data or files / "chat.jsonl"), "--device", "cpu"]
    args += ["--log", "wandb"] if case == "wandb" else []
    args += ["--dry-run"] if dry_run else ["-o", str(tmp_path / "run")]
    line = one_line_error(*rlctl(monkeypatch, capsys, *args))
    want = {"missing data": "missing.jsonl", "json array": "JSON array", "no tokenizer": "no tokenizer"}
    assert want.get(case, "pip install wandb") in line, line
    assert not (tmp_path / "run").exists()


def test_a_catalog_model_not_in_the_cache_is_refused_before_launch(monkeypatch, capsys, files, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    args = ["sft", "--model", "Qwen2.5-0.5B", "--data", str(files / "chat.jsonl"), "--device", "cpu"]
    line = one_line_error(*rlctl(monkeypatch, capsys, *args, "-o", str(tmp_path / "run")))
    assert "Qwen/Qwen2.5-0.5B" in line and "cache" in line, line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# 11: settings that run but learn nothing, or are probably a mistake


def test_grpo_with_temperature_0_is_refused(monkeypatch, capsys, tiny_model_dir, files):
    line = one_line_error(*rlctl(monkeypatch, capsys, *_grpo(tiny_model_dir, files, "--temperature", "0", "--dry-run")))
    assert "--temperature" in line and "advantage" in line, line


def test_a_causal_lm_as_reward_model_is_refused(monkeypatch, capsys, tiny_model_dir, files):
    args = _grpo(tiny_model_dir, files, "--reward-model", str(tiny_model_dir), "--dry-run")
    line = one_line_error(*rlctl(monkeypatch, capsys, *args))
    assert "causal LM" in line and "Qwen2ForCausalLM" in line, line


def test_an_unrelated_non_empty_output_dir_is_refused(monkeypatch, capsys, tiny_model_dir, files, tmp_path):
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "chapter1.tex").write_text("do not lose me\n")
    args = ["sft", "--model", str(tiny_model_dir), "--data", str(files / "chat.jsonl"), "--device", "cpu"]
    line = one_line_error(*rlctl(monkeypatch, capsys, *args, "-o", str(mine)))
    assert "not an rlctl run directory" in line and "chapter1.tex" in line, line
    assert sorted(p.name for p in mine.iterdir()) == ["chapter1.tex"]


def test_nproc_far_above_the_cores_warns_on_the_console(capsys, tiny_model_dir, files, tmp_path):
    import os

    from rlctl.job import ready_to_launch, resolve_job

    nproc = 3 * (os.cpu_count() or 1)
    opts = {"model.name": str(tiny_model_dir), "data.path": str(files / "chat.jsonl"), "hardware.device": "cpu"}
    opts |= {"hardware.nproc": nproc, "output_dir": str(tmp_path / "run")}
    ready_to_launch(resolve_job("sft", options=opts))
    err = capsys.readouterr().err
    assert f"--nproc {nproc}" in err and "warning" in err, err
