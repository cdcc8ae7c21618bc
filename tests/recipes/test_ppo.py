"""PPO with a critic, end to end on 2 CPU processes: the value loss falls, the adaptive KL
coefficient moves, and an interrupted run resumes with its critic."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli
from tests.support.rl import arith_rows, failure, rl_args, train_records
from tests.support.sft import write_jsonl


@pytest.mark.slow
def test_ppo_critic_learns_and_resumes(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(32))
    run = tmp_path / "run"
    args = rl_args(
        tiny_model_dir,
        data,
        run,
        "--rollout",
        "hf",
        "--max-steps",
        "6",
        "--n",
        "4",
        "--mini-batch-size",
        "2",
        "--kl-coef",
        "0.001",
        "--set",
        "algo.critic_lr=5e-3",
        "--set",
        "algo.kl_target=0.01",
        "--set",
        "checkpoint.export_hf=false",
    )
    first = run_cli("ppo", *args, env={"RLCTL_STOP_AFTER_STEP": "3"})
    assert first.returncode == 130, failure(first, run)
    state = json.loads((run / "checkpoints" / "step_000003" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["method"] == "ppo"
    assert (run / "checkpoints" / "step_000003" / "critic" / ".metadata").is_file()

    second = run_cli("ppo", *args, "--resume", "auto")
    assert second.returncode == 0, failure(second, run)
    assert "resumed from" in (run / "train.log").read_text()
    records = train_records(run)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert {"critic/value_loss", "critic/vf_clip_frac", "kl", "kl_coef"} <= set(records[-1])
    losses = [r["critic/value_loss"] for r in records]
    start = (losses[0] + losses[1]) / 2
    assert (losses[-1] + losses[-2]) / 2 < start / 4, losses
    assert losses[3] < start / 4, losses  # the step after the resume: the critic came back trained
    coefs = [r["kl_coef"] for r in records]
    assert coefs[0] == pytest.approx(0.001) and len(set(coefs)) > 1  # adaptive towards kl_target
    assert max(r["rollout/logprob_diff"] for r in records) < 1e-3
