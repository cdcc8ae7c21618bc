"""One-step-off-policy training (``--rollout-procs``, rlctl.recipes.rl.offpolicy): its schedule, its
refusals before launch, and two real split runs on CPU (torchrun, gloo, 1 rollout + 1 trainer process):
staleness 0 is the synchronous run, and a split run resumed from a checkpoint equals the one that went on."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import one_line_error, rlctl_in_process, run_cli
from tests.support.rl import arith_rows, failure, rl_args, train_records
from tests.support.rl_rewards import digits
from tests.support.sft import write_jsonl

VAL_ROWS = arith_rows(4, seed=1)


def test_schedule_of_weight_versions():
    from rlctl.recipes.rl.offpolicy import versions_needed, weights_version

    drains = {0, 4}  # the run's first step and a checkpoint after step 4
    # by hand: batch t uses the weights after update max(t - s, last drain <= t)
    assert [weights_version(t, 1, drains) for t in range(7)] == [0, 0, 1, 2, 4, 4, 5]
    assert [weights_version(t, 2, drains) for t in range(7)] == [0, 0, 0, 1, 4, 4, 4]
    assert [weights_version(t, 0, drains) for t in range(7)] == list(range(7))  # synchronous
    assert versions_needed(0, 7, 1, drains) == {0, 1, 2, 4, 5}
    assert versions_needed(4, 7, 1, {4}) == {4, 5}  # a resume at 4: its first batch from the checkpoint


def test_stale_batches_get_the_rollout_correction_by_default():
    from rlctl.algos.correction import correction_for

    kw = dict(level="token", upper=2.0, lower=None, reject=None)
    assert correction_for(None, "hf", **kw) is None
    assert correction_for(None, "hf", off_policy=True, **kw).mode == "tis"
    assert correction_for("none", "hf", off_policy=True, **kw) is None  # the user's choice wins


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (("--nproc", "1", "--rollout-procs", "1"), "needs at least 2 processes"),
        (("--nproc", "2", "--rollout-procs", "2"), "leaves no trainer among the 2 processes"),
        (("--nproc", "2", "--rollout-procs", "1", "--max-staleness", "-1"), "rollout.max_staleness=-1 must be >= 0"),
        # streaming (docs/async.md): rlctl.support's split_stream, and split_sampling for dynamic sampling
        (("--nproc", "2", "--rollout-mode", "stream"), "streams from rollout processes: add --rollout-procs 1"),
        (
            ("--nproc", "3", "--rollout-procs", "2", "--rollout-mode", "stream", "--rollout", "vllm"),
            "several rollout processes stream with the hf engine only (--rollout vllm",
        ),
        (("--nproc", "2", "--rollout-procs", "1", "--rollout-mode", "streaming"), "rollout.mode"),
        (
            ("--nproc", "2", "--rollout-procs", "1", "--rollout-mode", "stream", "--set", "algo.dynamic_sampling=true"),
            "algo.dynamic_sampling does not run with rollout.procs=1",
        ),
        (  # decoupled PPO weighs by proximal / behaviour itself: rlctl.support's behaviour_weighed_twice
            ("--nproc", "2", "--rollout-procs", "1", "--policy-loss", "decoupled")
            + ("--set", "algo.rollout_correction=tis"),
            "--policy-loss decoupled weighs each token by proximal / behaviour itself",
        ),
    ],
)
def test_refusals_before_launch(monkeypatch, capsys, tiny_model_dir, tmp_path, extra, expected):
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(8))
    args = ["grpo", "--model", str(tiny_model_dir), "--data", str(data), "--device", "cpu", *extra]
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args, "-o", str(tmp_path / "run")))
    assert expected in line, line
    assert not (tmp_path / "run").exists()


def test_ppo_is_refused(monkeypatch, capsys, tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(8))
    args = ["ppo", "--model", str(tiny_model_dir), "--data", str(data), "--device", "cpu", "--nproc", "2"]
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args, "--rollout-procs", "1"))
    assert "ppo is not supported with --rollout-procs" in line, line


def _same_numbers(a: list[dict], b: list[dict]) -> None:
    """The records agree on every key but timings (bit for bit: the same computation)."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not k.startswith("time") and k != "tokens_per_s"} & set(rb)
        assert len(keys) > 15
        assert {k: ra[k] for k in keys} == {k: rb[k] for k in keys}, ra["step"]


def _evals(run) -> list[dict]:
    """The eval records of metrics.jsonl (the last of a step wins), without their timing."""
    from rlctl.metrics import read_metrics

    by_step = {r["step"]: r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "eval"}
    return [{k: v for k, v in by_step[s].items() if not k.startswith("time")} for s in sorted(by_step)]


def _greedy_reward(model_dir, max_new_tokens: int = 12) -> float:
    """The mean `digits` reward of greedy responses to VAL_ROWS, by transformers' own generate on a
    saved HF model (the chat template as rlctl's data applies it): what rlctl's evaluation must report."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    rewards = []
    for row in VAL_ROWS:
        text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        response = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        rewards.append(digits("", response, row["answer"]))
    return sum(rewards) / len(rewards)


def _weights(run) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "hf" / "model.safetensors"))


def _assert_same_weights(a, b) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    assert all(wa[k].equal(wb[k]) for k in wa)


@pytest.mark.slow
def test_staleness_zero_is_the_synchronous_run(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(16))
    val = write_jsonl(tmp_path / "val.jsonl", VAL_ROWS)
    common = ("--rollout", "hf", "--max-steps", "3", "--batch-size", "2", "--n", "4")
    common += ("--val-data", str(val), "--eval-every", "2")

    def run(name: str, *extra: str):
        out = tmp_path / name
        result = run_cli("grpo", *rl_args(tiny_model_dir, data, out, *common, *extra))
        assert result.returncode == 0, failure(result, out)
        return out

    sync = run("sync", "--nproc", "1")
    split = run("split", "--nproc", "2", "--rollout-procs", "1", "--max-staleness", "0")
    a, b = train_records(sync), train_records(split)
    _same_numbers(a, b)
    assert [r["offpolicy/staleness"] for r in b] == [0.0, 0.0, 0.0] and "corr/is_mean" not in b[-1]
    assert a[0]["pg/loss"] != a[-1]["pg/loss"]  # it trained
    _assert_same_weights(sync, split)
    # evaluated by the trainer's own rollout engine, made for the first evaluation, on the current weights
    assert [r["step"] for r in _evals(split)] == [2, 3] and _evals(split) == _evals(sync)


@pytest.mark.slow
def test_split_run_resumes_exactly(tiny_model_dir, tmp_path):
    """Staleness 1 with a checkpoint after step 2: stopped there and resumed, the run equals the one that
    went on (the batch in flight at the checkpoint is regenerated from the checkpointed weights)."""
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(16))
    val = write_jsonl(tmp_path / "val.jsonl", VAL_ROWS)
    args = ("--rollout", "hf", "--max-steps", "4", "--batch-size", "2", "--n", "4", "--rollout-procs", "1")
    args += ("--save-every", "2", "--val-data", str(val), "--eval-every", "2")
    whole, part = tmp_path / "whole", tmp_path / "part"

    def grpo(run, *extra, env=None):
        full = rl_args(tiny_model_dir, data, run, *args, *extra)
        full[full.index("--lr") + 1] = "3e-3"  # the greedy answers change from step to step, not all to digits
        return run_cli("grpo", *full, env=env)

    first = grpo(whole)
    assert first.returncode == 0, failure(first, whole)
    stopped = grpo(part, env={"RLCTL_STOP_AFTER_STEP": "2"})
    assert stopped.returncode == 130, failure(stopped, part)
    resumed = grpo(part, "--resume", "auto")
    assert resumed.returncode == 0, failure(resumed, part)
    a, b = train_records(whole), train_records(part)
    assert [r["offpolicy/staleness"] for r in a] == [0.0, 1.0, 0.0, 1.0]  # step 3 starts after a checkpoint
    assert a[1]["corr/is_mean"] != 1.0  # the stale batch was corrected
    _same_numbers(a, b)
    _assert_same_weights(whole, part)
    assert json.loads((part / "summary.json").read_text())["status"] == "completed"
    # evaluations at steps 2 and 4 on the trainer's weights of that step (not the rollout process's, one
    # update behind): what transformers' greedy decoding of the checkpoint at step 2 and of the export scores
    from rlctl.convert.pipeline import fsdp_to_hf

    evals = _evals(whole)
    assert [r["step"] for r in evals] == [2, 4] and _evals(part) == evals
    assert fsdp_to_hf(whole / "checkpoints" / "step_000002", tmp_path / "step2").committed
    assert evals[0]["val/reward/mean"] == pytest.approx(_greedy_reward(tmp_path / "step2"), abs=1e-6)
    assert evals[1]["val/reward/mean"] == pytest.approx(_greedy_reward(whole / "hf"), abs=1e-6)
    assert evals[0]["val/reward/mean"] != evals[1]["val/reward/mean"]  # the weights moved between them
