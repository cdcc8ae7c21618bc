"""SFT of a tiny Qwen2-VL under torchrun (gloo, CPU): on 1 and on 2 processes, a run stopped after a checkpoint
and resumed equals the run that went on, number for number and weight for weight; 1 process trains as 2 do
(up to the fp summation order); the export loads with transformers' auto classes and its image processor and
answers about an image exactly as the trained model does in the hf rollout engine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.recipes.test_offpolicy import _assert_same_weights, _weights
from tests.support.rl import train_records
from tests.support.sft import cpu_plan, sft_config
from tests.support.vision import chat_row, chat_rows, png_bytes, write_parquet

RUN = {"checkpoint__save_every": 3, "train__max_steps": 6, "train__batch_size": 4, "train__lr": 1e-2}


@pytest.fixture(scope="module")
def vl_data(tmp_path_factory) -> Path:
    return write_parquet(tmp_path_factory.mktemp("vl") / "chat.parquet", chat_rows(16))


def _launch(model, data, out, nproc, env=None, **sets):
    from rlctl.launch import launch_job

    os.environ.update(env or {})
    try:
        return launch_job(sft_config(model, data, out, **{**RUN, **sets}), cpu_plan(nproc))
    finally:
        for k in env or {}:
            del os.environ[k]


@pytest.mark.slow
def test_vl_sft_resumes_exactly_on_one_and_two_processes_and_exports(tiny_vl_model_dir, vl_data, tmp_path):
    ref = {}
    for nproc in (2, 1):
        whole, part = tmp_path / f"whole{nproc}", tmp_path / f"part{nproc}"
        ref[nproc] = _stopped_and_resumed_equals_whole(tiny_vl_model_dir, vl_data, whole, part, nproc)
    summary = json.loads((tmp_path / "whole2" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["data"]["bad"] == 0
    # 1 process = 2 processes up to the fp summation order of the gradient reduction
    for a, b in zip(ref[1], ref[2]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), a["step"]
    one, two = _weights(tmp_path / "whole1"), _weights(tmp_path / "whole2")
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-4

    _check_export(tmp_path / "whole2", tiny_vl_model_dir, vl_data)


def _stopped_and_resumed_equals_whole(model: Path, data: Path, whole: Path, part: Path, nproc: int) -> list[dict]:
    """A run stopped after its step-3 checkpoint (as on Ctrl-C) and resumed on as many processes equals the
    run that went on: the same metrics and exported weights, bit for bit (data order, pixels, lr, AdamW)."""
    from rlctl.launch import INTERRUPTED

    assert _launch(model, data, whole, nproc) == 0
    ref = train_records(whole)
    assert [r["step"] for r in ref] == list(range(1, 7)) and ref[-1]["loss"] < ref[0]["loss"]
    assert _launch(model, data, part, nproc, {"RLCTL_STOP_AFTER_STEP": "3"}) == INTERRUPTED
    assert json.loads((part / "checkpoints" / "step_000003" / "trainer_state.json").read_text())["step"] == 3
    assert _launch(model, data, part, nproc, checkpoint__resume="auto") == 0
    numbers = ("step", "loss", "grad_norm", "lr", "loss_tokens", "epoch")
    assert [{k: r[k] for k in numbers} for r in train_records(part)] == [{k: r[k] for k in numbers} for r in ref]
    _assert_same_weights(whole, part)
    return ref


def _check_export(run: Path, initial_dir: Path, data: Path) -> None:
    """The export loads with the auto classes, has the image processor, was trained (weights moved, the vision
    tower frozen) and answers about an image (transformers' generate) exactly as the trained model does: the
    last checkpoint loaded into an engine, its weights synced into the hf rollout engine, greedy."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from rlctl.testing import vl_greedy_answer

    hf_dir = run / "hf"
    assert (hf_dir / "preprocessor_config.json").is_file()
    model = AutoModelForImageTextToText.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    images = AutoImageProcessor.from_pretrained(str(hf_dir))
    before = AutoModelForImageTextToText.from_pretrained(str(initial_dir), dtype=torch.float32).state_dict()
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(".visual." not in k for k in moved) and any("language_model" in k for k in moved)

    answer, ids, pixels = vl_greedy_answer(
        model, tok, images, png_bytes("red"), "Which colour is it?", max_new_tokens=8
    )
    engine_answer = _engine_greedy_answer(run, initial_dir, data, ids[0].tolist(), pixels, tok)
    assert answer == engine_answer and answer.startswith("It is"), (answer, engine_answer)


def _engine_greedy_answer(run: Path, initial_dir: Path, data: Path, ids: list[int], pixels, tok) -> str:
    """The last checkpoint (not the export) loaded into a one-process FSDP engine, its full weights synced into
    the hf rollout engine (built on the initial model), greedy decode of ``ids`` with the image."""
    import torch.distributed as dist

    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.rollout.base import SamplingParams
    from rlctl.rollout.hf import HFRolloutEngine
    from rlctl.rollout.spec import RolloutSpec
    from rlctl.runtime.checkpoint import load_checkpoint
    from rlctl.runtime.net import free_port
    from tests.support.sft import cpu_spec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        engine = FSDPEngine(cpu_spec(sft_config(initial_dir, data, run, **RUN)), total_steps=RUN["train__max_steps"])
        state, _ = load_checkpoint(run / "checkpoints" / "step_000006", {"": engine})
        assert state["step"] == 6
        rollout = HFRolloutEngine(RolloutSpec(model_path=str(initial_dir), max_model_len=len(ids) + 16))
        rollout.update_weights(engine.iter_full_params(dtype=torch.float32))
    finally:
        dist.destroy_process_group()
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    (sample,) = rollout.generate([ids], 1, greedy, images=[(pixels["pixel_values"], pixels["image_grid_thw"])])
    return tok.decode(sample.token_ids, skip_special_tokens=True)


@pytest.mark.slow
def test_vl_lora_with_the_tower_trained_converts_folded_and_verified(tiny_vl_model_dir, tmp_path):
    """LoRA with --train-vision (adapters on the tower's linear layers too) on 2 processes, with text-only rows:
    a rank whose micro-batch has no image runs the tower on a dummy image (else the ranks' collectives
    diverge). `rlctl convert` folds the adapters, verifies tensor by tensor against the checkpoint (and peft's
    own merge), and equals the run's export."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    from rlctl.convert.pipeline import fsdp_to_hf, lora_merge

    text_only = {**chat_row("red"), "images": []}
    text_only["messages"][0]["content"] = [{"type": "text", "text": "Say red.", "image": None}]
    data = write_parquet(tmp_path / "mixed.parquet", chat_rows(5) + [text_only] * 3)
    out = tmp_path / "run"
    sets = {"train__max_steps": 3, "train__batch_size": 3, "checkpoint__save_every": 0, "data__shuffle": False}
    lora = {"lora__rank": 4, "lora__alpha": 8, "model__train_vision": True}
    assert _launch(tiny_vl_model_dir, data, out, 2, **sets, **lora) == 0
    result = fsdp_to_hf(out / "checkpoints" / "step_000003", tmp_path / "converted")
    assert result.committed and result.verdict.ok, result.verdict.checks
    assert any("language_model" in n for n in result.folded) and any(".visual." in n for n in result.folded)
    assert (tmp_path / "converted" / "preprocessor_config.json").is_file()
    converted = load_file(str(tmp_path / "converted" / "model.safetensors"))
    exported = load_file(str(out / "hf" / "model.safetensors"))
    assert sorted(converted) == sorted(exported)
    assert all(torch.equal(converted[k], exported[k]) for k in converted)
    initial = AutoModelForImageTextToText.from_pretrained(str(tiny_vl_model_dir), dtype=torch.float32).state_dict()
    moved = {k for k in initial if not torch.equal(initial[k], converted[k])}
    assert any(".visual." in k for k in moved) and any("language_model" in k for k in moved)
    linear = {f"{n}.weight" for n in result.folded}
    assert moved <= linear  # folded linear layers only (the rest is frozen under LoRA)
    # the adapter kept apart, then merged into the hub-layout base (model.layers.*, visual.*: transformers'
    # save_pretrained names) by `rlctl convert lora-merge`: the same model
    kept = fsdp_to_hf(out / "checkpoints" / "step_000003", tmp_path / "kept", keep_adapter=True)
    assert kept.verdict.ok, kept.verdict.checks
    merged = lora_merge(tiny_vl_model_dir, tmp_path / "kept" / "adapter", tmp_path / "merged")
    assert merged.committed and merged.verdict.ok, merged.verdict.checks
    again = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert sorted(again) == sorted(converted)
    assert all(torch.allclose(again[k], converted[k], atol=1e-6) for k in converted)
