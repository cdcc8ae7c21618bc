"""The rollout browser sees whole GRPO groups, and the report leads with what moves (issue 37, item 12).

samples.jsonl: a real GRPO run (CLI, tiny model, 4 samples per prompt) logs every sample of a prompt,
so the browser (which groups by prompt) shows a group side by side; before, 4 samples of 4 prompts. The
report's charts: the reward and `acc` first, the failure counters (flat zero in a healthy run) after
every other section but "other", and no metric rlctl logs in "other"."""

from __future__ import annotations

import json

import pytest

from rlctl.recipes.rl.trainer import sample_rows
from rlctl.run_report import load_run
from rlctl.viewer.page import charts
from tests.support.cli import run_cli
from tests.support.rl import arith_rows, failure
from tests.support.sft import write_jsonl


def test_sample_rows_are_whole_groups_spread_over_the_batch():
    grpo = [g for g in range(4) for _ in range(8)]  # 4 prompts x 8 samples
    assert sample_rows(grpo, 4) == list(range(8))  # one whole group
    assert sample_rows(grpo, 12) == [*range(0, 8), *range(16, 24)]  # two groups, spread
    assert sample_rows(list(range(32)), 4) == [0, 8, 16, 24]  # PPO: groups of one, spread as before
    assert sample_rows([0, 0, 1, 1], 100) == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_grpo_run_logs_whole_groups_and_the_report_leads_with_the_reward(tiny_model_dir, tmp_path):
    data, run = write_jsonl(tmp_path / "rl.jsonl", arith_rows(16)), tmp_path / "run"
    args = ["grpo", "--model", str(tiny_model_dir), "--data", str(data), "--reward", "exact", "-o", str(run)]
    args += ["--max-prompt-len", "48", "--max-response-len", "12", "--device", "cpu", "--nproc", "1"]
    args += ["--batch-size", "4", "--n", "4", "--max-steps", "1", "--samples-every", "1"]
    res = run_cli(*args, "--set", "checkpoint.export_hf=false")
    assert res.returncode == 0, failure(res, run)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and len({s["prompt"] for s in samples}) == 1, [s["prompt"] for s in samples]
    found = charts([load_run(run)])
    sections = list(dict.fromkeys(c["section"] for c in found if c["kind"] == "train"))
    assert sections[0] == "reward" and [c["key"] for c in found[:2]] == ["acc", "reward"], found[:4]
    assert sections[-1] == "failures", sections
    assert {c["key"] for c in found if c["section"] == "failures"} == {
        "reward/errors",
        "reward/failed",
        "reward/nonfinite",
    }
    assert not [c["key"] for c in found if c["section"] == "other"]
