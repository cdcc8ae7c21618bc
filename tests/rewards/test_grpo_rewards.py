"""A GRPO CLI run with several weighted rewards (2 CPU processes, real torchrun)."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli
from tests.support.rl import REWARDS, arith_rows, failure, rl_args, train_records
from tests.support.sft import write_jsonl


@pytest.mark.slow
def test_grpo_with_weighted_rewards_logs_each_component(tiny_model_dir, tmp_path):
    rows = arith_rows(7) + [{"prompt": "What is 1 + 1?", "answer": "boom"}]  # digits fails on this row
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    run = tmp_path / "run"
    args = rl_args(tiny_model_dir, data, run, "--rollout", "hf", "--max-steps", "2")
    i = args.index("--reward")
    del args[i : i + 2]
    # the config side of `--reward gsm8k --reward format:0.2 --reward digits:0.5`
    args += ["--set", f"reward.fns=[gsm8k, 'format:0.2', '{REWARDS}:digits:0.5']", "--set", "reward.timeout=20"]
    res = run_cli("grpo", *args)
    assert res.returncode == 0, failure(res, run)
    records = train_records(run)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # the score is the weighted sum of the components, so its mean is the weighted sum of their means
        weighted = r["reward/gsm8k"] + 0.2 * r["reward/format"] + 0.5 * r["reward/digits"]
        assert r["reward/mean"] == pytest.approx(weighted, abs=1e-6)
        assert 0 <= r["reward/digits"] <= 1 and r["reward/nonfinite"] == 0
    assert sum(r["reward/failed"] for r in records) == 8  # the "boom" prompt once in 2 steps of 4 (n = 8)
    assert "reward/failed" in res.stdout + (run / "train.log").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rewards"] == {"reward/failed": 8, "reward/nonfinite": 0}
