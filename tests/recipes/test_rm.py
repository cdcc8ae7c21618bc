"""`rlctl rm` end to end on 2 CPU processes, then the chain RM -> PPO: the reward model learns the synthetic
preference (held-out accuracy), its export is a Hugging Face sequence classifier whose scores, computed by
plain transformers (rlctl.rewards.model, padded batches), equal the ones the run logged, and
`rlctl ppo --reward-model RUN/hf` is driven by it: every sample's reward is its score, and the held-out
score of the greedy answers rises."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli
from tests.support.pref import format_pairs
from tests.support.rl import failure, train_records
from tests.support.sft import write_jsonl


def _evals(run) -> list[dict]:
    from rlctl.metrics import read_metrics

    return [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "eval"]


@pytest.mark.slow
def test_rm_learns_exports_for_reward_model_and_drives_ppo(tiny_model_dir, tmp_path):
    from rlctl.data.rl import render_prompt
    from rlctl.rewards.model import RewardModel

    train, val = format_pairs(64, seed=0), format_pairs(16, seed=1)
    rm_run = tmp_path / "rm"
    base = ["--model", str(tiny_model_dir), "--device", "cpu", "--nproc", "2", "--batch-size", "8"]
    result = run_cli(
        "rm", *base, "--data", str(write_jsonl(tmp_path / "train.jsonl", train)), "--output-dir", str(rm_run),
        "--val-data", str(write_jsonl(tmp_path / "val.jsonl", val)), "--max-len", "64", "--lr", "1e-3",
        "--max-steps", "8", "--eval-before",
    )  # fmt: skip
    assert result.returncode == 0, failure(result, rm_run)
    after = _evals(rm_run)[-1]
    print(f"rm held-out accuracy {_evals(rm_run)[0]['eval_accuracy']:.0%} -> {after['eval_accuracy']:.0%}")
    assert after["eval_accuracy"] >= 0.9 and after["eval_margin"] > 1.0, after
    assert train_records(rm_run)[-1]["loss"] < 0.1

    config = json.loads((rm_run / "hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForSequenceClassification"] and len(config["id2label"]) == 1
    rm = RewardModel(str(rm_run / "hf"))  # what --reward-model loads: AutoModelForSequenceClassification
    prompts = [rm.tokenizer.decode(render_prompt(r["prompt"], rm.tokenizer, "prompt")) for r in val]
    chosen = rm.score(prompts, [r["chosen"] for r in val])
    rejected = rm.score(prompts, [r["rejected"] for r in val])
    assert sum(chosen) / len(val) == pytest.approx(after["eval_rewards/chosen"], abs=1e-4)
    assert sum(rejected) / len(val) == pytest.approx(after["eval_rewards/rejected"], abs=1e-4)
    assert sum(c > r for c, r in zip(chosen, rejected)) / len(val) == after["eval_accuracy"]

    ppo_run = tmp_path / "ppo"
    prompt_rows = lambda rows: [{"prompt": r["prompt"], "answer": ""} for r in rows]  # noqa: E731
    result = run_cli(
        "ppo", *base, "--data", str(write_jsonl(tmp_path / "p.jsonl", prompt_rows(train))),
        "--val-data", str(write_jsonl(tmp_path / "vp.jsonl", prompt_rows(val))), "--eval-before",
        "--reward-model", str(rm_run / "hf"), "--rollout", "hf", "--n", "4", "--max-prompt-len", "48",
        "--max-response-len", "12", "--max-steps", "10", "--lr", "3e-3", "--output-dir", str(ppo_run),
        "--set", "checkpoint.export_hf=false",
    )  # fmt: skip
    assert result.returncode == 0, failure(result, ppo_run)
    samples = [json.loads(line) for line in (ppo_run / "samples.jsonl").read_text().splitlines()]
    scores = rm.score([s["prompt"] for s in samples], [s["response"] for s in samples])
    assert [s["reward"] for s in samples] == pytest.approx(scores, abs=1e-4)  # the reward model is the reward
    before, after = _evals(ppo_run)[0]["val/reward/mean"], _evals(ppo_run)[-1]["val/reward/mean"]
    print(f"ppo held-out reward-model score {before:.3f} -> {after:.3f}")
    assert after > before
