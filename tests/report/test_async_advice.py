"""`rlctl report`'s async line: the streaming cost model (rlctl.plan.streaming.streaming_decision) applied to
the parts read here by hand from the run's own metrics.jsonl (tests/report/fixtures/grpo_tiny: a real 8-step
GRPO run on 2 CPU processes, whose update dominates its rollout)."""

from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from rlctl.plan.streaming import StreamParts, streaming_decision
from tests.support.cli import run_cli
from tests.support.sft import chat_rows, write_jsonl

FIXTURE = Path(__file__).parent / "fixtures" / "grpo_tiny"


@pytest.fixture
def run_dir(tmp_path) -> Path:
    d = Path(shutil.copytree(FIXTURE, tmp_path / "grpo_tiny"))
    (d / "config.yaml").write_text("method: grpo\nhardware:\n  nproc: 2\n")  # the fixture's 2 processes
    return d


def _by_hand(run_dir: Path, scale_rollout: float = 1.0) -> StreamParts:
    """The parts as the model's docstring defines them, read here: steps 2.. (step 1 is warm-up), each
    process's time x 2 for one process's, a lockstep group's latency = the batch's rollout."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r.get("kind") != "eval" and "time/rollout" in r][1:]
    rollout = 2 * statistics.fmean(r["time/rollout"] for r in steps) * scale_rollout
    update = 2 * statistics.fmean(r["time/update"] + r["time/logprobs"] for r in steps)
    sync = statistics.fmean(r["time/weight_sync"] for r in steps)
    return StreamParts(rollout, rollout, update, sync, update / 2, rollout / 2, (rollout,), 1, batch=32)


def _report(run_dir: Path) -> dict:
    r = run_cli("report", str(run_dir), "--json", "--no-plot", "--no-html")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["runs"][0]["async"]


def test_update_bound_run_does_not_pay_and_says_so(run_dir):
    got = _report(run_dir)
    want = streaming_decision(_by_hand(run_dir))
    assert got["value"]["mode"] == want.value["mode"] == "fixed"
    assert got["why"].startswith(want.why)  # the same numbers, then what was assumed
    assert "does not pay" in got["why"] and "assumed: streaming decodes a batch as fast as lockstep" in got["why"]
    text = run_cli("report", str(run_dir), "--no-plot", "--no-html")
    assert text.returncode == 0, text.stderr
    said = " ".join(text.stdout.split())
    assert "async" in said and "stream does not pay" in said


def test_tool_bound_run_pays_with_the_flags(run_dir):
    """The same run as a tool-heavy agent job: its rollout 30 x slower, 90% of it the batch's waits for
    tools (``time/tools``, recorded by multi-turn runs); streaming overlaps those waits, so it pays, and
    the line names the flags with the staleness the model needs."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    for r in rows:
        if "time/rollout" in r:
            r["time/rollout"] *= 30
            r["time/tools"] = 0.9 * r["time/rollout"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = _report(run_dir)
    p = _by_hand(run_dir)
    steps = [r for r in rows if "time/tools" in r][1:]
    p = replace(p, stream_generate_s=p.lockstep_rollout_s - 2 * statistics.fmean(r["time/tools"] for r in steps))
    want = streaming_decision(p)
    assert want.value["mode"] == got["value"]["mode"] == "stream"
    assert got["why"].startswith(want.why) and "it pays" in got["why"]
    s = want.value["max_staleness"]
    assert s > 1  # the slow groups need more in flight than the run's --max-staleness 1
    assert got["value"]["flags"] == f"--rollout-procs 1 --rollout-mode stream --max-staleness {s}"
    text = run_cli("report", str(run_dir), "--no-plot", "--no-html")
    assert f"--max-staleness {s}" in " ".join(text.stdout.split())


def test_dry_run_of_a_split_grpo_job_says_what_decides_streaming(tmp_path):
    """Before a run the plan predicts no seconds, so it names the measured inputs and where the answer comes
    from (rlctl report of a first run), as data in plan.json's decisions."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    args = ("--model", "Qwen2.5-0.5B", "--data", str(data), "--dry-run", "-o", str(tmp_path / "r"), "--device", "cpu")
    split = (*args, "--nproc", "2", "--rollout-procs", "1", "--max-staleness", "2")
    r = run_cli("grpo", *split, "--json")
    assert r.returncode == 0, r.stderr
    mode = [d for d in json.loads(r.stdout)["plan"]["decisions"] if d["key"] == "rollout.mode"]
    assert [d["value"] for d in mode] == [{"mode": "fixed", "max_staleness": 2, "predicted": False}]
    assert "not predicted" in mode[0]["why"] and "`rlctl report RUN` of a first run" in mode[0]["why"]
    text = run_cli("grpo", *split)
    assert "rollout.mode=fixed at --max-staleness 2, not predicted" in " ".join(text.stdout.split())
    colocated = run_cli("grpo", *args, "--json")  # no split: no streaming decision in the plan
    assert not [d for d in json.loads(colocated.stdout)["plan"]["decisions"] if d["key"] == "rollout.mode"]
