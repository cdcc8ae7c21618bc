"""`rlctl grpo` on a tiny Qwen2-VL (CPU, gloo, the hf rollout engine with images, shared-prefix passes): it
trains on 1 and on 2 processes, the trainer's log-probs equal the rollout engine's (fp32), and a run stopped
after a checkpoint and resumed equals the run that went on, number for number."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.recipes.test_offpolicy import _assert_same_weights, _same_numbers
from tests.support.cli import REPO, run_cli
from tests.support.rl import REWARDS, failure, train_records

sys.path.insert(0, str(REPO / "examples" / "vlm_colors"))
import colors  # noqa: E402


def vl_args(model_dir: Path, data: Path, out: Path, nproc: int, *extra: str) -> list[str]:
    return [
        *("--model", str(model_dir), "--data", str(data), "--output-dir", str(out), "--device", "cpu"),
        *("--nproc", str(nproc), "--batch-size", "4", "--n", "4", "--max-prompt-len", "128"),
        *("--max-response-len", "6", "--lr", "1e-2", "--rollout", "hf", "--reward", f"{REWARDS}:digits"),
        *("--set", "model.attn=sdpa"),
        *extra,
    ]


@pytest.mark.slow
def test_vl_grpo_one_and_two_processes_and_an_exact_resume(tiny_vl_model_dir, tmp_path):
    data = colors.write_rl_parquet(tmp_path / "rl.parquet", colors.make_pictures(16, seed=3))
    one = tmp_path / "one"
    res = run_cli("grpo", *vl_args(tiny_vl_model_dir, data, one, 1, "--max-steps", "1"))
    assert res.returncode == 0, failure(res, one)
    log = (one / "train.log").read_text()
    assert "rollout: hf engine" in log
    records = train_records(one)
    assert [r["step"] for r in records] == [1] and max(r["rollout/logprob_diff"] for r in records) < 1e-5

    args = ("--max-steps", "3", "--save-every", "2")
    whole, part = tmp_path / "whole", tmp_path / "part"
    res = run_cli("grpo", *vl_args(tiny_vl_model_dir, data, whole, 2, *args))
    assert res.returncode == 0, failure(res, whole)
    stopped = run_cli("grpo", *vl_args(tiny_vl_model_dir, data, part, 2, *args), env={"RLCTL_STOP_AFTER_STEP": "2"})
    assert stopped.returncode == 130, failure(stopped, part)
    resumed = run_cli("grpo", *vl_args(tiny_vl_model_dir, data, part, 2, *args, "--resume", "auto"))
    assert resumed.returncode == 0, failure(resumed, part)
    a, b = train_records(whole), train_records(part)
    assert max(r["rollout/logprob_diff"] for r in a) < 1e-5  # images and mrope as in generation
    assert any(r["grad_norm"] > 0 for r in a) and a[0]["reward/std"] > 0  # it trained on a signal
    _same_numbers(a, b)
    _assert_same_weights(whole, part)
    assert (whole / "hf" / "preprocessor_config.json").is_file()  # the export carries the image processor
    assert json.loads((part / "summary.json").read_text())["status"] == "completed"
