"""SFT of a tiny Qwen2-VL under torchrun (gloo, CPU): 2 processes as the reference; 1 process stopped after
step 12 and resumed on 2 gives the same losses; the export loads with transformers' auto classes and its
image processor and answers about an image."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.support.sft import cpu_plan, losses, sft_config
from tests.support.vision import chat_row, chat_rows, png_bytes, write_parquet

RUN = {"checkpoint__save_every": 12, "train__max_steps": 24, "train__batch_size": 4, "train__lr": 1e-2}


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
def test_vl_sft_two_processes_resume_from_one_and_export(tiny_vl_model_dir, vl_data, tmp_path):
    from rlctl.launch import INTERRUPTED

    ref = tmp_path / "ref"
    assert _launch(tiny_vl_model_dir, vl_data, ref, 2) == 0
    ref_losses = losses(ref)
    assert sorted(ref_losses) == list(range(1, 25)) and ref_losses[24] < ref_losses[1]
    summary = json.loads((ref / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["data"]["bad"] == 0

    out = tmp_path / "resumed"
    assert _launch(tiny_vl_model_dir, vl_data, out, 1, {"RLCTL_STOP_AFTER_STEP": "12"}) == INTERRUPTED
    assert _launch(tiny_vl_model_dir, vl_data, out, 2, checkpoint__resume="auto") == 0
    got = losses(out)
    # 1 process = 2 processes, and the first step after the resume continues exactly (weights, AdamW, data
    # order, lr); later steps only up to the fp summation order of 1 vs 2 processes, which lr 1e-2 amplifies
    for step in range(1, 14):
        assert got[step] == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-6), step
    for step in range(14, 25):
        assert got[step] == pytest.approx(ref_losses[step], rel=2e-2), step

    _check_export(ref / "hf", tiny_vl_model_dir)


def _check_export(hf_dir: Path, initial_dir: Path) -> None:
    """The export loads with the auto classes, has the image processor, was trained (weights moved, the vision
    tower frozen) and generates an answer about an image."""
    import io

    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    assert (hf_dir / "preprocessor_config.json").is_file()
    model = AutoModelForImageTextToText.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    images = AutoImageProcessor.from_pretrained(str(hf_dir))
    before = AutoModelForImageTextToText.from_pretrained(str(initial_dir), dtype=torch.float32).state_dict()
    after = model.state_dict()
    assert sorted(after) == sorted(before)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and all(".visual." not in k for k in moved) and any("language_model" in k for k in moved)

    pixels = images(images=[Image.open(io.BytesIO(png_bytes("red"))).convert("RGB")], return_tensors="pt")
    n = int(pixels["image_grid_thw"].prod()) // 4
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour is it?"}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text.replace("<|image_pad|>", "<|image_pad|>" * n), add_special_tokens=False, return_tensors="pt")
    ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(ids == model.config.image_token_id).int(),
            max_new_tokens=8,
            do_sample=False,
        )
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer.startswith("It is"), answer


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
