"""Tool-using GRPO with ``--rollout-procs 1`` (docs/async.md): 1 rollout + 1 trainer process (torchrun,
gloo, CPU), the tiny model trained to call its tool. The fixed schedule at staleness 0 is the colocated
synchronous agent run, number for number and weight for weight; a streaming run with a sleeping tool,
stopped with groups in flight and resumed, trains every group exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.agents.conftest import TOOLS_FILE
from tests.recipes.test_offpolicy import _assert_same_weights, _same_numbers
from tests.support.cli import run_cli
from tests.support.rl import failure, train_records
from tests.support.sft import write_jsonl

pytestmark = pytest.mark.slow
REWARD = Path(__file__).resolve().parents[1] / "support" / "agent_rewards.py"
SLEEPY = TOOLS_FILE.replace("    return a + b", "    import time\n\n    time.sleep(0.2)\n    return a + b")


def _args(model_dir: Path, tmp: Path, run: Path, nproc: int, *extra: str, tools: str = TOOLS_FILE) -> list[str]:
    (tmp / "tools.py").write_text(tools)
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ((3, 4), (1, 6), (2, 5), (0, 7))]
    data = write_jsonl(tmp / "data.jsonl", rows * 2)
    return [
        "--model", str(model_dir), "--data", str(data), "--output-dir", str(run), "--device", "cpu",
        "--nproc", str(nproc), "--batch-size", "2", "--n", "4", "--max-prompt-len", "160",
        "--max-response-len", "96", "--lr", "1e-3", "--reward", f"{REWARD}:answered", "--tools", str(tmp / "tools.py"),
        "--max-turns", "3", "--rollout", "hf", "--samples-every", "1", *extra,
    ]  # fmt: skip


def _tools_ran(run: Path, records: list[dict], *, errors_ok: bool = False) -> None:
    """The tool ran and its result came back (``errors_ok``: a call the model wrote without arguments may come
    back as the tool's error message, still a result)."""
    assert sum(r["tool/calls"] for r in records) > 0
    assert errors_ok or all(r["tool/errors"] == 0 for r in records)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert any(m["role"] == "tool" and m["content"] == "7" for s in samples for m in s["messages"])


def test_fixed_schedule_at_staleness_zero_is_the_synchronous_agent_run(agent_model_dir, tmp_path):
    runs = {}
    for name, extra in (("sync", ("--nproc", "1")), ("split", ("--rollout-procs", "1", "--max-staleness", "0"))):
        runs[name] = tmp_path / name
        nproc = "1" if name == "sync" else "2"
        res = run_cli("grpo", *_args(agent_model_dir, tmp_path, runs[name], int(nproc), "--max-steps", "2", *extra))
        assert res.returncode == 0, failure(res, runs[name])
    a, b = train_records(runs["sync"]), train_records(runs["split"])
    _same_numbers(a, b)  # every non-timing metric, the turn and tool counts among them
    assert [r["offpolicy/staleness"] for r in b] == [0.0, 0.0]
    _tools_ran(runs["split"], b)
    _assert_same_weights(runs["sync"], runs["split"])


@pytest.mark.parametrize("procs", [1, 2])
def test_stream_with_a_sleeping_tool_resumed_trains_every_group_once(agent_model_dir, tmp_path, procs):
    """Stopped after step 2 (a checkpoint with groups in flight) and resumed to 4: every one of the 8 stream
    positions trained exactly once; the sleeping tool ran, its results were context (mask 0: the trainer's
    log-probs of the sampled tokens match the pool's behaviour ones where the weights did not move). With 1
    and with 2 rollout processes (one global admission)."""
    run = tmp_path / "run"
    args = ("--max-steps", "4", "--rollout-procs", str(procs), "--rollout-mode", "stream", "--max-staleness", "1")
    args += ("--save-every", "2", "--set", "rollout.stream_chunk=8")
    first = run_cli("grpo", *_args(agent_model_dir, tmp_path, run, procs + 1, *args, tools=SLEEPY),
                    env={"RLCTL_STOP_AFTER_STEP": "2"})  # fmt: skip
    assert first.returncode == 130, failure(first, run)
    second = run_cli("grpo", *_args(agent_model_dir, tmp_path, run, procs + 1, *args, "--resume", "auto", tools=SLEEPY))
    assert second.returncode == 0, failure(second, run)
    state = json.loads((run / "checkpoints" / "step_000004" / "trainer_state.json").read_text())["stream_trained"]
    assert state["frontier"] + len(state["extra"]) == 8  # a position trained twice would count once
    records = train_records(run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    keys = ("async/staleness", "async/staleness_max", "async/versions_per_trajectory", "async/idle_trainer_s")
    assert all(k in r for r in records for k in (*keys, "async/idle_rollout_s", "async/queue_groups"))
    assert all(r["async/staleness_max"] <= 1 for r in records) and records[0]["async/staleness"] == 0.0
    # 2 processes sample with seeds of their own: at lr 1e-3 the policy drifts, and a call without arguments
    # came back as add()'s error in one draw (a tool result all the same)
    _tools_ran(run, records, errors_ok=procs > 1)
    assert records[0]["rollout/logprob_diff"] < 1e-3  # the first batch: one version, tool tokens not compared
