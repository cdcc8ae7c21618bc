"""Ranks killed (SIGKILL) at the points where a run can die, then ``--resume auto``: real torchrun runs
of the tiny model on 2 CPU processes (gloo). After every kill each ``step_N`` directory is whole (the
leftovers of the save are ``.tmp-*`` only); the resumed run ends with exactly the weights of an
uninterrupted run with the same seed (the exported safetensors, tensor by tensor, within 1e-6).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlctl.runtime.checkpoint import FAULT_ENV
from rlctl.runtime.layout import checkpoint_problem, step_name
from tests.support.cli import run_cli
from tests.support.rl import arith_rows, failure, rl_args
from tests.support.sft import chat_rows, cpu_plan, sft_config, write_jsonl

pytestmark = pytest.mark.slow

SFT = {"checkpoint__save_every": 2, "checkpoint__keep_last": 2, "train__max_steps": 6}


def _weights(run: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted((run / "hf").glob("*.safetensors"))
    assert files, f"no exported model in {run / 'hf'}"
    out: dict = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _assert_same_weights(got: Path, want: Path) -> None:
    a, b = _weights(got), _weights(want)
    assert sorted(a) == sorted(b)
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= 1e-6, f"the resumed run's weights differ from the uninterrupted run's by {worst}"


def _step_dirs_whole(run: Path) -> list[str]:
    """The checkpoint directory's entries; every step_N in it must be whole."""
    ckpts = run / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    for name in names:
        if name.startswith("step_"):
            assert checkpoint_problem(ckpts / name) is None, (name, checkpoint_problem(ckpts / name))
    return names


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("faults") / "chat.jsonl", chat_rows(40))


def _sft(model: Path, data: Path, out: Path, *, fault: str = "", **sets) -> int:
    from rlctl.launch import launch_job

    if fault:
        os.environ[FAULT_ENV] = fault
    try:
        return launch_job(sft_config(model, data, out, **{**SFT, **sets}), cpu_plan(2))
    finally:
        os.environ.pop(FAULT_ENV, None)


def test_sft_killed_anywhere_resumes_to_the_uninterrupted_weights(tiny_model_dir, chat_file, tmp_path):
    reference = tmp_path / "reference"
    assert _sft(tiny_model_dir, chat_file, reference) == 0
    out = tmp_path / "run"
    ckpts = out / "checkpoints"

    # 1. rank 1 dies right after step 3: the step-2 checkpoint is the newest
    assert _sft(tiny_model_dir, chat_file, out, fault="step:3:1") != 0
    assert _step_dirs_whole(out) == ["latest", step_name(2)]
    # 2. resumed from step 2, rank 0 dies with the step-4 save complete but not yet renamed
    assert _sft(tiny_model_dir, chat_file, out, fault="rename:4", checkpoint__resume="auto") != 0
    assert _step_dirs_whole(out) == [".tmp-step_000004", "latest", step_name(2)]
    # 3. resumed from step 2 again; rank 0 dies after the rename, before ``latest`` is updated
    assert _sft(tiny_model_dir, chat_file, out, fault="latest:4", checkpoint__resume="auto") != 0
    assert _step_dirs_whole(out) == ["latest", step_name(2), step_name(4)]  # the leftover was cleaned
    assert (ckpts / "latest").read_text().strip() == step_name(2)
    # 4. step 4's shard of rank 1 is truncated: auto passes over it to step 2 and says so; rank 0 dies
    #    while pruning step 2 after the final save (keep_last 2)
    shard = ckpts / step_name(4) / "__1_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    assert _sft(tiny_model_dir, chat_file, out, fault="prune:6", checkpoint__resume="auto") != 0
    log = (out / "train.log").read_text()
    assert (
        f"resuming from {step_name(2)}: {step_name(4)} is damaged ({shard} truncated: {size // 2} of {size} bytes)"
        in log
    )
    assert _step_dirs_whole(out) == [f".tmp-old-{step_name(2)}", "latest", step_name(4), step_name(6)]
    # 5. resumed at the last step: nothing left to train, the model is exported
    assert _sft(tiny_model_dir, chat_file, out, checkpoint__resume="auto") == 0
    assert _step_dirs_whole(out) == ["latest", step_name(4), step_name(6)]
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    _assert_same_weights(out, reference)


def test_grpo_killed_mid_run_resumes_to_the_uninterrupted_weights(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "prompts.jsonl", arith_rows(16))

    def grpo(out: Path, *extra: str, fault: str = ""):
        args = rl_args(tiny_model_dir, data, out, "--rollout", "hf", "--max-steps", "4", *extra)
        return run_cli("grpo", *args, "--set", "checkpoint.save_every=2", env={FAULT_ENV: fault} if fault else None)

    reference = tmp_path / "reference"
    res = grpo(reference)
    assert res.returncode == 0, failure(res, reference)
    out = tmp_path / "run"
    assert grpo(out, fault="step:3:1").returncode != 0
    assert _step_dirs_whole(out) == ["latest", step_name(2)]
    res = grpo(out, "--resume", "auto")
    assert res.returncode == 0, failure(res, out)
    _assert_same_weights(out, reference)
