"""The memory estimate of vision-language models: the vision tower's parameters (frozen or trained), the
image tokens in the sequence, the tower's activations, and the plan that explains them."""

from __future__ import annotations

import math

import pytest

from rlctl.catalog import resolve_gpu, resolve_model
from rlctl.errors import UserError
from rlctl.estimate import MemorySettings, estimate_memory
from rlctl.estimate.inventory import lora_params
from tests.plan.test_plan import plan_for
from tests.support.cli import rlctl_in_process

VL7 = resolve_model("Qwen2.5-VL-7B")
H100 = resolve_gpu("H100-80GB")
P = 8_292_166_656  # Qwen2.5-VL-7B, all parameters (tests/catalog: equal to transformers' count)
V = 676_550_144  # its vision tower, computed by hand in tests/catalog/test_catalog.py


def training(**kw) -> dict[str, int]:
    est = estimate_memory(VL7, H100, MemorySettings(method="grpo", gpus=8, **kw))
    return est.phases["training"].components | {"trainable": est.trainable_params}


def test_frozen_tower_has_no_gradients_or_adamw_states():
    frozen = training()
    # FSDP keeps every parameter in fp32 (mixed precision), the frozen tower's too; only the rest trains
    assert frozen["weights"] == math.ceil(4 * P / 8)
    assert frozen["gradients"] == math.ceil(4 * (P - V) / 8)
    assert frozen["optimizer_states"] == math.ceil(8 * (P - V) / 8)
    assert frozen["trainable"] == P - V
    trained = training(train_vision=True)
    assert trained["gradients"] == math.ceil(4 * P / 8) and trained["optimizer_states"] == P
    assert trained["trainable"] == P


def test_lora_adapters_on_the_tower_only_when_it_trains():
    text = lora_params(VL7, 16)
    assert training(lora_rank=16)["trainable"] == text
    # every linear of the tower: per block qkv (1280 -> 3840), proj, gate/up/down (3420); the merger's two
    w, f = 1280, 3420
    tower = 16 * (32 * (w + 3 * w + w + w + 3 * (w + f)) + (5120 + 5120) + (5120 + 3584))
    assert training(lora_rank=16, train_vision=True)["trainable"] == text + tower


def test_images_add_tokens_and_the_towers_activations():
    s = MemorySettings(method="grpo", gpus=8, micro_batch=1, prompt_len=512, response_len=1024)
    est = estimate_memory(VL7, H100, s)
    # one image at the processor's max_pixels (28 x 28 x 1280): 5120 patches, 1280 merged tokens
    assert (est.settings.image_patches, est.settings.image_tokens) == (5120, 1280)
    assert est.settings.seq_len == 512 + 1280 + 1024
    # frozen: one block's transient in bf16: 8 x 1280 (norms, inputs, q/k/v, output) + 4 x 3420 (gated MLP)
    block = 2 * 5120 * (8 * 1280 + 4 * 3420)
    assert est.phases["training"].components["vision_activations"] == block
    # trained under activation checkpointing: every block's input is kept as well
    ckpt = estimate_memory(VL7, H100, MemorySettings(**{**s.to_dict(), "train_vision": True}))
    assert ckpt.phases["training"].components["vision_activations"] == 32 * 2 * 5120 * 1280 + block
    # smaller images: 448 x 448 pixels are 16 x 16 merged tokens
    small = estimate_memory(VL7, H100, MemorySettings(**{**s.to_dict(), "image_pixels": 448 * 448, "images": 2}))
    assert (small.settings.image_tokens, small.settings.seq_len) == (512, 512 + 512 + 1024)
    text = estimate_memory(resolve_model("Qwen2.5-7B"), H100, s)
    assert text.settings.image_tokens == 0 and "vision_activations" not in text.phases["training"].components


def test_vl_models_train_on_fsdp():
    p = plan_for("grpo", model={"name": "Qwen2.5-VL-72B"}, hardware={"gpus": 16, "gpu": "H100-80GB"})
    assert p.backend == "fsdp"
    assert any("Megatron engine does not run a vision-language model" in r for r in p.reasons)
    with pytest.raises(UserError, match="vision-language model"):
        plan_for("grpo", model={"name": "Qwen2.5-VL-7B"}, hardware={"gpus": 8}, parallel={"backend": "megatron"})
    with pytest.raises(UserError, match="vision-language model"):
        estimate_memory(VL7, H100, MemorySettings(method="sft", gpus=8, backend="megatron", tp=8))


def test_estimate_memory_names_the_vision_tower(monkeypatch, capsys):
    code, out = rlctl_in_process(
        monkeypatch, capsys, "estimate", "memory", "--model", "Qwen2.5-VL-7B", "--method", "grpo", "--gpus", "8"
    )
    out = " ".join(out.split())  # rich wraps lines
    assert code == 0, out
    assert "vision tower (Qwen2.5-VL ViT: 32 blocks of width 1280, patch 14, merge 2x2): 676,550,144 parameters" in out
    assert "frozen" in out and "no gradients or AdamW states" in out
    assert "5120 patches of 14x14 each through the vision tower, merged into 1280 tokens" in out
    assert "vision tower activations" in out
    assert "fits: " in out


def test_vl_models_roll_out_with_an_engine_that_takes_images():
    lora = plan_for("grpo", model={"name": "Qwen2.5-VL-7B"}, hardware={"gpus": 8}, lora={"rank": 16})
    assert lora.rollout == "sglang"  # LoRA would pick vllm for a text model
    assert any("vllm engine takes no images" in r for r in lora.reasons)
    with pytest.raises(UserError, match="rollout.engine=vllm takes no images"):
        plan_for("grpo", model={"name": "Qwen2.5-VL-7B"}, hardware={"gpus": 8}, rollout={"engine": "vllm"})


def test_train_vision_flag_reaches_the_estimate(monkeypatch, capsys):
    args = ("estimate", "memory", "--model", "Qwen2.5-VL-7B", "--method", "grpo", "--gpus", "8", "--train-vision")
    code, out = rlctl_in_process(monkeypatch, capsys, *args)
    assert code == 0 and "trained (--train-vision): full states like the text model" in " ".join(out.split())
