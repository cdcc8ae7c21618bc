"""Ulysses sequence parallelism (``parallel.sp``) on the FSDP engine, 2 processes, tiny Qwen2 (2 heads,
1 KV head: sp 2 repeats it), fp32.

sp 2 is compared with sp 1 on the same processes (the worker runs both), and with the unsharded
HF rollout engine's log-probs; a run saved with sp 2 resumes with sp 1 and converts like any other.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from tests.support.cli import REPO, run_cli, torchrun
from tests.support.rl import arith_rows, failure, rl_args, train_records
from tests.support.sft import chat_rows, cpu_plan, losses, sft_config, write_jsonl

WORKER = REPO / "tests" / "support" / "scripts" / "sp_equivalence.py"
TOL = 1e-5


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_sp2_gives_the_losses_gradients_and_logprobs_of_sp1(tiny_model_dir, tmp_path):
    """SFT (packed, padded, LoRA + activation checkpointing, selective checkpointing + activation
    offload; the LM head at each shard's labelled positions, and sp 2's equals sp 1's at every position)
    and GRPO (packed and shared-prefix: log-probs, entropy, reference log-probs, a critic's values, one
    update): sp 2 == sp 1 to 1e-5; the sp 2 checkpoint loads into an sp 1 engine exactly."""
    out, env = tmp_path / "out.pt", {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        torchrun(2, WORKER, tiny_model_dir, out, tmp_path / "ckpt"),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = torch.load(out, weights_only=False)
    for variant, one in r["sft"][1].items():
        two = r["sft"][2][variant]
        assert two["loss"] == pytest.approx(one["loss"], rel=TOL), variant
        assert _max_diff(one["grads"], two["grads"]) < TOL, variant
        assert one["logits"].shape == two["logits"].shape == (1, 37, 512)
        assert float((one["logits"] - two["logits"]).abs().max()) < TOL, variant  # after the step
        assert max(float(g.abs().max()) for g in one["grads"].values()) > 1e-3, variant  # gradients, not zeros
    kept, full = r["sft"][2]["packed"], r["sft"][1]["packed_full"]  # sp 2, each shard's labelled positions only
    assert kept["loss"] == pytest.approx(full["loss"], rel=TOL) and _max_diff(kept["grads"], full["grads"]) < TOL
    for prefix, one in r["grpo"][1].items():
        two = r["grpo"][2][prefix]
        assert one["logp"].keys() == two["logp"].keys() and len(one["logp"]) == 16  # every sample, by uid
        for uid, values in one["logp"].items():
            for a, b in zip(values, two["logp"][uid]):
                assert float((a - b).abs().max()) < TOL, (prefix, uid)
        assert _max_diff(one["grads"], two["grads"]) < TOL, prefix
        for key in ("grad_norm", "pg/loss", "pg/approx_kl", "kl_loss"):
            assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=TOL, abs=1e-7), (prefix, key)
    assert _max_diff(r["saved"], r["loaded"]) == 0.0  # exact: the weights' layout does not depend on sp
    assert r["optim"] == 0.0 and r["steps"] == (1, 1)
    assert r["attn"] == ["rlctl_ulysses", "rlctl_ulysses"]  # rank 0 built the random weights, and kept it


@pytest.mark.slow
def test_recipes_run_with_sp2_resume_with_sp1_and_convert(tiny_model_dir, tmp_path):
    """`rlctl grpo --sp 2`: its log-probs are the unsharded HF rollout engine's; SFT with sp 2, resumed
    from its step-2 checkpoint with sp 1, repeats steps 3-4; `rlctl convert` of an sp 2 checkpoint
    is the run's own export."""
    from rlctl.launch import launch_job

    data = write_jsonl(tmp_path / "rl.jsonl", arith_rows(8))
    run = tmp_path / "grpo"
    res = run_cli(
        "grpo", *rl_args(tiny_model_dir, data, run, "--max-steps", "1", "--sp", "2", "--rollout", "hf", "--n", "4")
    )
    assert res.returncode == 0, failure(res, run)
    (step,) = train_records(run)
    assert step["rollout/logprob_diff"] < TOL and step["grad_norm"] > 0

    chat = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
    sp2, sp1 = tmp_path / "sft2", tmp_path / "sft1"
    sets = {"train__max_steps": 4, "checkpoint__save_every": 2, "checkpoint__keep_last": 3}
    assert launch_job(sft_config(tiny_model_dir, chat, sp2, parallel__sp=2, **sets), cpu_plan(2)) == 0
    assert "sp: 2" in (sp2 / "config.yaml").read_text()
    resume = str(sp2 / "checkpoints" / "step_000002")
    assert launch_job(sft_config(tiny_model_dir, chat, sp1, checkpoint__resume=resume, **sets), cpu_plan(2)) == 0
    two, one = losses(sp2), losses(sp1)
    assert sorted(one) == [3, 4]
    for s in (3, 4):
        assert one[s] == pytest.approx(two[s], rel=TOL), s
    state = json.loads((sp2 / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert state["step"] == 4
    res = run_cli("convert", "fsdp-to-hf", str(sp2 / "checkpoints" / "step_000004"), str(tmp_path / "hf"))
    assert res.returncode == 0, res.stdout + res.stderr
    from safetensors.torch import load_file

    exported, converted = (load_file(str(d / "model.safetensors")) for d in (sp2 / "hf", tmp_path / "hf"))
    assert _max_diff(exported, converted) == 0.0
