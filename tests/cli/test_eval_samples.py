"""Evaluation, rollout samples and the run report, end to end through the CLI (real torchrun runs of the
tiny model on 2 CPU processes)."""

from __future__ import annotations

import json
import math

import pytest

from tests.support.browser import check_curves, non_blank, open_page
from tests.support.cli import run_cli
from tests.support.rl import arith_rows, failure, rl_args
from tests.support.sft import chat_rows, write_jsonl


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_grpo_eval_samples_and_report(tiny_model_dir, tmp_path):
    """--val-data / --eval-every / --eval-n: greedy reward + acc, mean@4, pass@4 in metrics.jsonl and on
    the console; --samples-every: samples.jsonl whose reward / advantage agree with the step's; the
    report's curves equal metrics.jsonl and the reward rises."""
    pytest.importorskip("matplotlib")
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(32))
    val = write_jsonl(tmp_path / "val.jsonl", arith_rows(4, seed=9))
    run = tmp_path / "run"
    args = ["--rollout", "hf", "--max-steps", "8", "--val-data", str(val), "--eval-every", "4", "--eval-n", "4"]
    args += ["--eval-before"]
    res = run_cli("grpo", *rl_args(tiny_model_dir, data, run, *args, "--samples-every", "3"))
    assert res.returncode == 0, failure(res, run)
    records = _lines(run / "metrics.jsonl")
    train = [r for r in records if r.get("kind") != "eval"]
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [e["step"] for e in evals] == [0, 4, 8]  # --eval-before: the baseline at step 0
    for e in evals:
        assert {"val/reward/mean", "val/mean@4", "val/pass@4", "time/eval"} <= set(e)
        assert 0 <= e["val/pass@4"] <= 1 and 0 <= e["val/mean@4"] <= 1
    assert "eval at step 8: val/reward/mean" in res.stderr + res.stdout

    samples = _lines(run / "samples.jsonl")
    assert sorted({s["step"] for s in samples}) == [1, 3, 6, 8]  # the first step, every 3rd, the last
    # log.samples=4 in whole groups: one group of --n 8 each time (issue 37: a group is seen side by side)
    assert all(len([s for s in samples if s["step"] == k]) == 8 for k in (1, 3, 6, 8))
    for s in samples:
        # the digits reward, recomputed here from the decoded response
        text = s["response"]
        assert s["reward"] == pytest.approx(sum(c.isdigit() for c in text) / max(1, len(text)), abs=0.05)
        assert math.isfinite(s["advantage"]) and s["prompt"].count("What is") == 1
    assert "sample at step 3: reward" in res.stderr + res.stdout

    rep = run_cli("report", str(run), "--json")
    assert rep.returncode == 0, rep.stderr
    panels = json.loads((run / "report.json").read_text())["panels"]
    reward = panels["reward"]["reward"]
    assert (reward["x"], reward["y"]) == (list(range(1, 9)), [r["reward"] for r in train])
    assert panels["eval"]["val/pass@4"]["y"] == [e["val/pass@4"] for e in evals]
    y = panels["reward"]["reward"]["y"]
    assert sum(y[-2:]) / 2 > sum(y[:2]) / 2 + 0.08, y  # the reward rises
    assert (run / "report.png").stat().st_size > 20_000

    # the HTML report of this real run, in headless Chromium: every curve has as many points as
    # metrics.jsonl has values; choosing a step shows exactly that step's samples; no network request
    html = run / "report.html"
    with open_page(html) as (page, requests, errors):
        assert check_curves(page, run) >= 25
        assert page.eval_on_selector_all(
            '.chart[data-metric="val/reward/mean"] [data-points]', "els => els.map(e => +e.getAttribute('data-points'))"
        ) == [3]
        for step in (1, 6):
            page.select_option("#step-select", str(step))
            shown = page.eval_on_selector_all(".sample", "els => els.map(e => +e.getAttribute('data-reward'))")
            assert sorted(shown) == sorted(s["reward"] for s in samples if s["step"] == step)
            texts = page.eval_on_selector_all(".sample pre", "els => els.map(e => e.textContent)")
            assert sorted(texts) == sorted(s["response"] for s in samples if s["step"] == step)
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        assert non_blank(shot) > 0.05
    assert errors == [] and requests == [html.resolve().as_uri()]


@pytest.mark.slow
def test_sft_val_fraction_reports_validation_loss(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "chats.jsonl", chat_rows(40))
    run = tmp_path / "run"
    res = run_cli(
        "sft",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data),
        "-o",
        str(run),
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--max-steps",
        "4",
        "--batch-size",
        "8",
        "--max-len",
        "96",
        "--lr",
        "3e-3",
        "--val-fraction",
        "0.2",
        "--eval-every",
        "2",
        "--set",
        "checkpoint.export_hf=false",
    )
    assert res.returncode == 0, failure(res, run)
    evals = [r for r in _lines(run / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [e["step"] for e in evals] == [2, 4] and all(0 < e["val_loss"] < 20 for e in evals)
    assert evals[1]["val_loss"] < evals[0]["val_loss"]
    rep = run_cli("report", str(run), "--json", "--no-plot")
    summary = json.loads(rep.stdout)["runs"][0]
    assert summary["metric"] == "loss" and [e["val_loss"] for e in summary["evals"]] == [e["val_loss"] for e in evals]
