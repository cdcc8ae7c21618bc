"""`rlctl report`: the summary and the curves of a run, checked against its metrics.jsonl read here by hand.

fixtures/grpo_tiny is a real run's record: 8 GRPO steps of the tiny model on the digits reward (2 CPU
processes, validation every 4 steps with --eval-n 4), whose reward rose from 0.52 to 0.76.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cli import REPO, run_cli

FIXTURE = Path(__file__).parent / "fixtures" / "grpo_tiny"


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURE, tmp_path / "grpo_tiny"))


def test_report_plots_exactly_the_metrics_and_the_reward_rises(run_dir):
    pytest.importorskip("matplotlib")
    r = run_cli("report", str(run_dir), "--json")
    assert r.returncode == 0, r.stderr
    png = run_dir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    plotted = json.loads((run_dir / "report.json").read_text())["panels"]
    records = _lines(run_dir / "metrics.jsonl")
    train = [r for r in records if r.get("kind") != "eval"]
    evals = [r for r in records if r.get("kind") == "eval"]
    for panel, key in [
        ("reward", "reward"),
        ("KL", "kl"),
        ("entropy", "entropy"),
        ("response length", "response_len/mean"),
        ("tokens/s", "tokens_per_s"),
        ("loss", "pg/loss"),
    ]:
        line = plotted[panel][key]
        assert (line["x"], line["y"]) == ([r["step"] for r in train], [r[key] for r in train]), panel
        assert line["smoothed"] == pytest.approx(_ema([r[key] for r in train], 0.6)), panel
    assert plotted["eval"]["val/mean@4"] == {"x": [4, 8], "y": [e["val/mean@4"] for e in evals]}
    for panel, key in [("grad norm", "grad_norm"), ("lr", "lr"), ("time", "time/update"), ("tokens/s", "tokens")]:
        assert plotted[panel][key]["y"] == [r[key] for r in train], panel  # every logged metric is drawn
    rewards = plotted["reward"]["reward"]["y"]
    assert rewards[-1] > rewards[0] + 0.15  # the run learned: the curve rises

    summary = json.loads(r.stdout)["runs"][0]
    assert summary["steps"] == 8 and summary["metric"] == "reward"
    assert summary["first"] == train[0]["reward"] and summary["last"] == train[-1]["reward"]
    assert summary["best"] == max(r["reward"] for r in train)
    assert summary["tokens_per_s"] == pytest.approx(sum(r["tokens_per_s"] for r in train) / len(train))
    assert [e["step"] for e in summary["evals"]] == [4, 8] and summary["hf"] == "hf"


def _ema(values: list[float], w: float) -> list[float]:
    """TensorBoard's debiased EMA, worked out here: s_t = w s_(t-1) + (1 - w) x_t, divided by 1 - w^t."""
    out, s = [], 0.0
    for t, x in enumerate(values, start=1):
        s = w * s + (1 - w) * x
        out.append(s / (1 - w**t))
    return out


def test_the_figure_draws_what_the_sidecar_says(run_dir):
    pytest.importorskip("matplotlib")
    from rlctl.run_report import load_run, plot

    fig = plot([load_run(run_dir)], run_dir / "r.png", sidecar=run_dir / "r.json")
    sidecar = json.loads((run_dir / "r.json").read_text())["panels"]
    seen = 0
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        assert all(float(t).is_integer() for t in ax.get_xticks())  # steps are whole numbers
        for line in ax.get_lines():
            label = line.get_label()
            want = sidecar[ax.get_title()][label.removeprefix("_raw:")]
            y = want["y"] if label.startswith("_raw:") or "smoothed" not in want else want["smoothed"]
            assert list(line.get_xdata()) == want["x"] and list(line.get_ydata()) == y
            seen += 1
    assert seen == sum(len(v) + sum("smoothed" in e for e in v.values()) for v in sidecar.values()) >= 30


def test_compare_overlays_two_runs(run_dir, tmp_path):
    pytest.importorskip("matplotlib")
    other = Path(shutil.copytree(FIXTURE, tmp_path / "other"))
    recs = _lines(other / "metrics.jsonl")
    for rec in recs:
        if "reward" in rec:
            rec["reward"] = rec["reward"] / 2
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "cmp.png"
    r = run_cli("report", str(run_dir), "--compare", str(other), "-o", str(out))
    assert r.returncode == 0, r.stderr
    reward = json.loads(out.with_suffix(".json").read_text())["panels"]["reward"]
    assert reward["other: reward"]["y"] == [y / 2 for y in reward["grpo_tiny: reward"]["y"]]
    said = "".join(r.stdout.split())  # the console wraps long paths (a pytest-xdist worker's tmp path is longer)
    assert "grpo_tiny" in said and "other" in said
    assert not (run_dir / "report.png").exists()  # the run's own report is not overwritten
    fig_colors = {}
    from rlctl.run_report import load_run, plot

    fig = plot([load_run(run_dir), load_run(other)], tmp_path / "c.png")
    for line in fig.axes[0].get_lines():
        fig_colors.setdefault(line.get_label().removeprefix("_raw:").split(":")[0], set()).add(line.get_color())
    assert len(fig_colors["grpo_tiny"]) == len(fig_colors["other"]) == 1  # one colour per run ...
    assert fig_colors["grpo_tiny"] != fig_colors["other"]  # ... and the runs' colours differ


def test_sft_run_summary_best_is_the_lowest_loss_and_nan_is_kept(tmp_path):
    from rlctl.metrics import MetricsLogger
    from rlctl.run_report import load_run, summarize

    run = tmp_path / "sft"
    logger = MetricsLogger(run / "metrics.jsonl", backends="")
    for step, loss in enumerate([2.0, 1.5, float("nan"), 1.2, 1.4], start=1):
        logger.log({"step": step, "total_steps": 5, "loss": loss, "tokens_per_s": 100.0, "time/step": 1.0})
    logger.log({"step": 5, "kind": "eval", "val_loss": 1.3})
    logger.close()
    s = summarize(load_run(run))
    assert (s["metric"], s["first"], s["last"], s["best"], s["best_step"]) == ("loss", 2.0, 1.4, 1.2, 4)
    assert s["nonfinite_steps"] == [3] and s["evals"] == [{"step": 5, "val_loss": 1.3}]


def test_nan_reaches_the_loggers_as_a_float_and_jsonl_as_null(tmp_path):
    from rlctl.metrics import MetricsLogger, read_metrics

    got = []

    class Writer:  # what TensorBoard's SummaryWriter receives
        def add_scalar(self, key, value, step):
            got.append((key, value, step))

        def close(self):
            pass

    logger = MetricsLogger(tmp_path / "metrics.jsonl", backends="")
    logger._tb = Writer()
    logger.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-5})
    logger.close()
    loss = [v for k, v, _ in got if k == "train/loss"]
    assert len(loss) == 1 and isinstance(loss[0], float) and math.isnan(loss[0])
    assert [v for k, v, _ in got if k == "train/grad_norm"] == [math.inf]
    line = json.loads((tmp_path / "metrics.jsonl").read_text())  # strict JSON: no NaN token
    assert line["loss"] is None and line["nonfinite"] == {"loss": "nan", "grad_norm": "inf"}
    (back,) = read_metrics(tmp_path / "metrics.jsonl")
    assert math.isnan(back["loss"]) and back["grad_norm"] == math.inf and "nonfinite" not in back


def test_without_matplotlib_one_line_names_the_extra(run_dir):
    probe = (
        "import sys; sys.modules['matplotlib'] = None; sys.argv = ['rlctl', 'report', sys.argv[1]]; "
        "from rlctl.cli.app import main; main()"
    )
    r = subprocess.run([sys.executable, "-c", probe, str(run_dir)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr  # the HTML report needs no matplotlib; only the PNG is skipped
    note = "note: no PNG: rlctl report draws its PNG with matplotlib: pip install 'rlctl[plot]' (--no-plot skips it)"
    assert note in r.stdout.splitlines()
    assert (run_dir / "report.html").is_file() and not (run_dir / "report.png").exists()
    r = subprocess.run([sys.executable, "-c", probe.replace("'report', ", "'report', '--no-html', "), str(run_dir)],
                       capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "error: rlctl report draws its PNG with matplotlib: pip install 'rlctl[plot]'"
    ]
    assert run_cli("report", str(run_dir), "--no-plot").returncode == 0


def test_not_a_run_directory_is_one_line(tmp_path):
    r = run_cli("report", str(tmp_path / "nope"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no run directory" in r.stderr
