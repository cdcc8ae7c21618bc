"""`rlctl dpo` end to end on 2 CPU processes (torchrun, FSDP2, the tiny model): DPO raises the held-out
preference accuracy of a synthetic task (the chosen answer has the ``#### N`` line the rejected one lacks); a
LoRA run with a per-step reference (the base, adapters off) and a KTO run start at their formulas' values at
zero margin and learn."""

from __future__ import annotations

import json
import math

import pytest

from tests.support.cli import run_cli
from tests.support.pref import format_pairs
from tests.support.rl import failure, train_records
from tests.support.sft import write_jsonl


def _args(model, data, run, *extra) -> list[str]:
    return [
        "--model", str(model), "--data", str(data), "--output-dir", str(run), "--device", "cpu", "--nproc", "2",
        "--batch-size", "8", "--max-len", "64", "--lr", "1e-3", "--set", "checkpoint.export_hf=false", *extra,
    ]  # fmt: skip


def _evals(run) -> list[dict]:
    from rlctl.metrics import read_metrics

    return [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "eval"]


@pytest.mark.slow
def test_dpo_raises_held_out_preference_accuracy(tiny_model_dir, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", format_pairs(64, seed=0))
    val = write_jsonl(tmp_path / "val.jsonl", format_pairs(16, seed=1))
    run = tmp_path / "run"
    result = run_cli("dpo", *_args(tiny_model_dir, train, run, "--val-data", val, "--max-steps", "8", "--eval-before"))
    assert result.returncode == 0, failure(result, run)
    before, after = _evals(run)[0], _evals(run)[-1]
    accuracy = "eval_rewards/accuracies"
    print(f"held-out preference accuracy {before[accuracy]:.0%} -> {after[accuracy]:.0%}")
    assert before["step"] == 0 and before["eval_loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy = reference
    assert before["eval_rewards/accuracies"] == 0.0 and before["eval_rewards/margins"] == pytest.approx(0, abs=1e-5)
    assert after["eval_rewards/accuracies"] >= 0.9 and after["eval_rewards/margins"] > 0.5, after
    records = train_records(run)
    assert records[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert records[-1]["loss"] < 0.5 * math.log(2)
    keys = {
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    }
    assert keys <= set(records[-1])
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["lora-per-step-reference", "kto"])
def test_lora_reference_and_kto_start_at_zero_margin_and_learn(variant, tiny_model_dir, tmp_path):
    pairs = format_pairs(32, seed=0)
    if variant == "kto":  # every other row: the chosen answer (good) or the rejected one (bad)
        rows = [{"prompt": r["prompt"], "completion": r["chosen" if i % 2 == 0 else "rejected"], "label": i % 2 == 0}
                for i, r in enumerate(pairs)]  # fmt: skip
        extra, start = ["--loss", "kto"], 0.5  # 1 - sigmoid(0) at r = z0 = 0
    else:
        rows, start = pairs, math.log(2)
        extra = ["--lora-rank", "8", "--no-precompute-ref", "--lr", "1e-2"]
    data, run = write_jsonl(tmp_path / "data.jsonl", rows), tmp_path / "run"
    result = run_cli("dpo", *_args(tiny_model_dir, data, run, "--max-steps", "3", *extra))
    assert result.returncode == 0, failure(result, run)
    records = train_records(run)
    assert records[0]["loss"] == pytest.approx(start, abs=1e-5)
    # the reference stayed the start (a LoRA policy whose "reference" followed it would stay at ln 2)
    assert records[-1]["loss"] < start - 0.05 and records[-1]["rewards/margins"] > 0, records
    if variant == "kto":
        assert "kl" in records[-1] and "rewards/accuracies" not in records[-1]
