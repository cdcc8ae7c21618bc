"""Vision-language models (tiny Qwen2-VL and Qwen2.5-VL) on the FSDP2 engine, one process: their log-probs
against a plain transformers forward on the same images and tokens, the frozen vision tower, LoRA on the
language model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.sft import cpu_spec, sft_config
from tests.support.vision import chat_row, write_parquet

pytestmark = pytest.mark.usefixtures("process_group")  # one gloo process (tests/conftest.py)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl_dir(request, tiny_vl_model_dir, tmp_path_factory):
    """The tiny Qwen2-VL of the session, and a tiny Qwen2.5-VL (window attention in its vision tower)."""
    from rlctl.testing import build_tiny_vl_model

    if request.param == "qwen2_vl":
        return tiny_vl_model_dir
    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl25") / "model", arch=request.param)


@pytest.fixture(scope="module")
def vl(vl_dir, tmp_path_factory):
    """The processor, a config and three examples: two images of different sizes and a text-only row."""
    from transformers import AutoTokenizer

    from rlctl.data.sft import build_sft_data
    from rlctl.data.vision import load_processor

    vp = load_processor(str(vl_dir), AutoTokenizer.from_pretrained(str(vl_dir)))
    text_row = chat_row("red")
    text_row["messages"][0]["content"] = [{"type": "text", "text": "Say red."}]
    del text_row["images"]
    rows = [chat_row("red", size=(84, 56)), text_row, chat_row("blue", size=(56, 112))]
    tmp = tmp_path_factory.mktemp("vl")
    cfg = sft_config(vl_dir, write_parquet(tmp / "d.parquet", rows), tmp / "run", data__shuffle=False)
    data = build_sft_data(cfg, vp.tokenizer, vision=vp)
    assert [ex.pixel_values is not None for ex in data.train] == [True, False, True]
    return vp, cfg, data.train


def _engine(cfg, **overrides):
    from rlctl.engines.fsdp import FSDPEngine

    return FSDPEngine(cpu_spec(cfg, **overrides), trainable=True, total_steps=4)


def _token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    keep = labels != -100
    return torch.log_softmax(logits[keep].float(), -1).gather(-1, labels[keep][:, None])[:, 0]


def _plain_logprobs(model, ex) -> torch.Tensor:
    """transformers alone: the example's ids, pixels and image grid; the model computes its own positions."""
    ids = torch.as_tensor(ex.input_ids, dtype=torch.long)[None]
    kwargs = {}
    if ex.pixel_values is not None:
        kwargs = {
            "pixel_values": torch.as_tensor(ex.pixel_values),
            "image_grid_thw": torch.as_tensor(ex.image_grid_thw),
            "mm_token_type_ids": (ids == model.config.image_token_id).int(),
        }
    with torch.no_grad():
        logits = model(input_ids=ids, **kwargs).logits
    return _token_logprobs(logits[0], torch.as_tensor(ex.labels, dtype=torch.long))


@pytest.mark.parametrize("packed", [True, False])
def test_logprobs_equal_a_plain_transformers_forward(vl, vl_dir, packed):
    from transformers import AutoModelForImageTextToText

    from rlctl.data.packing import collate_packed, collate_padded

    vp, cfg, examples = vl
    engine = _engine(cfg)
    engine.train(False)
    mb = collate_packed(examples) if packed else collate_padded(examples, vp.tokenizer.pad_token_id)
    assert mb.pixel_values.shape[0] == sum(int(ex.image_grid_thw.prod(-1).sum()) for ex in (examples[0], examples[2]))
    with torch.no_grad():
        logits = engine.forward_micro(mb)
    if packed:
        ours = _token_logprobs(logits[0], mb.labels[0])
    else:
        ours = torch.cat([_token_logprobs(logits[r], mb.labels[r]) for r in range(len(examples))])
    ref = AutoModelForImageTextToText.from_pretrained(
        str(vl_dir), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    theirs = torch.cat([_plain_logprobs(ref, ex) for ex in examples])
    assert ours.shape == theirs.shape and ours.numel() > 10
    assert (ours - theirs).abs().max().item() <= 1e-5
    # the images matter: the same tokens without their pixels give other log-probs
    blind = ref(input_ids=torch.as_tensor(examples[0].input_ids, dtype=torch.long)[None]).logits
    assert (
        _token_logprobs(blind[0], torch.as_tensor(examples[0].labels, dtype=torch.long))
        - _plain_logprobs(ref, examples[0])
    ).abs().max() > 1e-4


def test_vision_tower_is_frozen_by_default_and_its_own_unit(vl):
    from torch.distributed.fsdp import FSDPModule

    from rlctl.data.packing import collate_packed
    from rlctl.engines.vision import vision_tower

    _, cfg, examples = vl
    engine = _engine(cfg)
    tower = vision_tower(engine.parts.hf)
    assert isinstance(tower, FSDPModule) and not any(isinstance(b, FSDPModule) for b in tower.blocks)
    assert not any(p.requires_grad for p in tower.parameters())
    before = {n: p.full_tensor().clone() for n, p in engine.model.named_parameters()}
    mb = collate_packed(examples)
    engine.forward_backward(
        [mb], lambda logits, mb: (F.cross_entropy(logits[0], mb.labels[0], ignore_index=-100), None)
    )
    engine.step()
    changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p.full_tensor(), before[n])}
    assert changed and not any(".visual." in n for n in changed)
    assert any("language_model" in n for n in changed)

    trained = _engine(cfg, train_vision=True)
    assert all(p.requires_grad for p in vision_tower(trained.parts.hf).parameters())


def test_lora_targets_the_language_model_only_unless_the_tower_is_trained(vl):
    from peft.tuners.lora import LoraLayer

    from rlctl.engines.spec import LoraSpec

    _, cfg, _ = vl

    def lora_layers(**overrides):
        engine = _engine(cfg, lora=LoraSpec(rank=4), **overrides)
        return [n for n, m in engine.model.named_modules() if isinstance(m, LoraLayer)]

    layers = lora_layers()
    assert layers and all("language_model" in n for n in layers)
    assert any(".visual." in n for n in lora_layers(train_vision=True))
