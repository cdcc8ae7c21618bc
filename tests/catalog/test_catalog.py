"""The catalogs: parameter counts against transformers, name resolution, GPU lookups, the docs.

Every count is checked against the model transformers builds on the meta device (no memory, no
weights): ``sum(p.numel() for p in model.parameters())`` counts tied weights once, as we do.
DeepSeek-V3 (671B) builds on meta in well under a second, so it is checked at full size.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DeepseekV3Config,
    LlamaConfig,
    Qwen3MoeConfig,
)

from rlctl.catalog import (
    active_params,
    catalog_markdown,
    count_params,
    embedding_params,
    hf_config_dict,
    kv_cache_bytes_per_token,
    layer_params,
    list_gpus,
    list_models,
    resolve_gpu,
    resolve_model,
)
from rlctl.catalog.count import vision_params
from rlctl.errors import UserError

REPO = Path(__file__).resolve().parents[2]
MODELS = list_models()


def meta_model(config):
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def decoder_layers(model):
    inner = model.model
    return getattr(inner, "language_model", inner).layers  # a VL model's text model is model.language_model


def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def same_architecture(a, b) -> bool:
    """Equal in every field but the naming ones (extra is not compared by ModelSpec's ==)."""
    naming = dict(name="", hf_id="", source="")
    return dataclasses.replace(a, **naming) == dataclasses.replace(b, **naming)


# --- counts against transformers -----------------------------------------------------------------


@pytest.mark.parametrize("spec", MODELS, ids=[s.name for s in MODELS])
def test_counts_match_transformers(spec):
    model = meta_model(AutoConfig.for_model(**hf_config_dict(spec)))
    assert count_params(spec) == numel(model)
    assert embedding_params(spec) == model.get_input_embeddings().weight.numel()
    assert layer_params(spec) == max(numel(layer) for layer in decoder_layers(model))
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == spec.tie_embeddings
    assert vision_params(spec) == (numel(model.model.visual) if spec.is_vl else 0)


def test_vision_tower_counts_by_hand():
    """The vision towers of Qwen2.5-VL-7B and Qwen2-VL-7B, computed by hand from their published config.json."""
    patch_embed = 3 * 2 * 14 * 14 * 1280  # Conv3d(3, 1280, (2, 14, 14)), no bias
    attention = (1280 * 3 * 1280 + 3 * 1280) + (1280 * 1280 + 1280)  # qkv and proj, with biases
    # Qwen2.5-VL-7B: RMSNorms, gated MLP of width 3420 with biases; merger to 3584
    block = 2 * 1280 + attention + 2 * (1280 * 3420 + 3420) + (3420 * 1280 + 1280)
    merger = 1280 + (5120 * 5120 + 5120) + (5120 * 3584 + 3584)
    assert vision_params(resolve_model("Qwen2.5-VL-7B")) == patch_embed + 32 * block + merger == 676_550_144
    # Qwen2-VL-7B: LayerNorms (weight and bias), fc1/fc2 of width 4 x 1280 with biases
    block = 2 * 2 * 1280 + attention + (1280 * 5120 + 5120) + (5120 * 1280 + 1280)
    merger = 2 * 1280 + (5120 * 5120 + 5120) + (5120 * 3584 + 3584)
    assert vision_params(resolve_model("Qwen2-VL-7B")) == patch_embed + 32 * block + merger == 675_759_104
    # Hugging Face's parameter counts of the safetensors: 8.29B for both 7B models
    assert round(count_params(resolve_model("Qwen2.5-VL-7B")) / 1e9, 2) == 8.29
    assert round(count_params(resolve_model("Qwen2-VL-7B")) / 1e9, 2) == 8.29


def test_vision_patches_and_tokens_at_the_processor_bounds():
    v = resolve_model("Qwen2.5-VL-7B").vision
    # max_pixels 28 x 28 x 1280: 1280 groups of 2 x 2 patches of 14 x 14
    assert (v.patches(10**8), v.image_tokens(10**8)) == (5120, 1280)
    assert (v.patches(448 * 448), v.image_tokens(448 * 448)) == (1024, 256)  # 16 x 16 groups
    assert v.image_tokens(1) == 4  # min_pixels 56 x 56: 2 x 2 groups


def test_published_figures():
    assert count_params(resolve_model("Qwen2.5-7B")) == 7_615_616_512  # Qwen2.5 model card: 7.61B
    assert round(count_params(resolve_model("Llama-3.1-8B")) / 1e9, 2) == 8.03  # Meta: 8.03B
    deepseek = resolve_model("DeepSeek-V3")
    assert round(count_params(deepseek) / 1e9) == 671  # main model; the MTP module is on top
    assert deepseek.mtp_layers == 1
    assert 37e9 < active_params(deepseek) < 38e9  # "37B activated"
    assert 3.3e9 < active_params(resolve_model("Qwen3-30B-A3B")) < 3.4e9  # "3.3B activated"


def test_active_params_against_the_expert_tensors():
    """Active = total minus the experts a token does not use, counted from the built model."""
    spec = resolve_model("Qwen3-30B-A3B")
    model = meta_model(AutoConfig.for_model(**hf_config_dict(spec)))
    expert_params = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    idle = expert_params * (spec.num_experts - spec.experts_per_token) // spec.num_experts
    assert active_params(spec) == numel(model) - idle
    dense = resolve_model("Qwen2.5-7B")
    assert active_params(dense) == count_params(dense)


def test_kv_cache_bytes_per_token():
    # Qwen2.5-7B: K and V, 28 layers x 4 kv heads x 128 dims, bf16 -> 57,344 bytes (56 KiB).
    assert kv_cache_bytes_per_token(resolve_model("Qwen2.5-7B")) == 2 * 28 * 4 * 128 * 2
    # DeepSeek-V3 (MLA): the 512-d latent plus the 64-d rope key per layer, 61 layers.
    assert kv_cache_bytes_per_token(resolve_model("DeepSeek-V3"), dtype_bytes=1) == 61 * 576


def write_config(config, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    config.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=100,
            attention_bias=True,
            mlp_bias=True,
        ),
        DeepseekV3Config(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=100,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            first_k_dense_replace=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=12,
            attention_bias=True,
            n_group=2,
            topk_group=1,
        ),
        Qwen3MoeConfig(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=100,
            num_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=True,
        ),
    ],
    ids=["llama-biases", "deepseek-no-q-lora", "qwen3-moe-tied"],
)
def test_counts_of_local_configs_with_uncommon_options(config, tmp_path):
    """Options no catalog entry uses (biases, MLA without q compression, 2 shared experts, tying)."""
    spec = resolve_model(str(write_config(config, tmp_path, "m")))
    model = meta_model(AutoConfig.from_pretrained(tmp_path / "m"))
    assert count_params(spec) == numel(model)
    assert layer_params(spec) == max(numel(layer) for layer in model.model.layers)


# --- resolution ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("Qwen2.5-7B", "Qwen2.5-7B"),
        ("qwen2.5-7b", "Qwen2.5-7B"),
        ("Qwen/Qwen2.5-7B-Instruct", "Qwen2.5-7B"),
        ("QWEN/QWEN2.5-7B-INSTRUCT", "Qwen2.5-7B"),
        ("Qwen3-30B-A3B-Base", "Qwen3-30B-A3B"),
        ("meta-llama/Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "Llama-3.1-8B"),
        ("google/gemma-2-9b-it", "Gemma-2-9B"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "Mistral-7B"),
        ("deepseek-ai/DeepSeek-V3-Base", "DeepSeek-V3"),
        ("llama-3.2-1b-instruct", "Llama-3.2-1B"),
    ],
)
def test_resolve_catalog_names(name, expected):
    assert resolve_model(name).name == expected


@pytest.mark.parametrize("spec", MODELS, ids=[s.name for s in MODELS])
def test_resolve_a_config_saved_by_transformers(spec, tmp_path):
    """A config written by transformers' save_pretrained reads back as the same architecture."""
    model_dir = write_config(AutoConfig.for_model(**hf_config_dict(spec)), tmp_path, spec.name)
    from_dir = resolve_model(str(model_dir))
    from_file = resolve_model(str(model_dir / "config.json"))
    assert same_architecture(from_dir, spec) and same_architecture(from_file, spec)
    assert from_dir.source == str(model_dir) and from_dir.name == str(model_dir)  # the path typed (issue 37)
    assert count_params(from_dir) == count_params(spec)


def test_resolve_reads_plain_json(tmp_path):
    """A hand-written config.json (transformers 4 style, no head_dim) gets head_dim = hidden / heads."""
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "vocab_size": 1000,
        "rope_theta": 500000.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = resolve_model(str(tmp_path))
    assert (spec.head_dim, spec.num_kv_heads, spec.rope_theta) == (32, 8, 500000.0)
    assert not spec.tie_embeddings


def test_unknown_model_suggests_names():
    with pytest.raises(UserError, match=r"unknown model 'qwen2.5-7'.*did you mean .*Qwen2.5-7B"):
        resolve_model("qwen2.5-7")
    with pytest.raises(UserError, match=r"unknown model 'gpt-9'.*Qwen2.5-0.5B.*local HF model directory"):
        resolve_model("gpt-9")


def test_bad_local_paths(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(UserError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    with pytest.raises(UserError, match="model_type 'bert' is not supported"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    with pytest.raises(UserError, match="no 'num_attention_heads'"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="cannot read"):
        resolve_model(str(tmp_path))


def test_hf_config_dict_keeps_architecture_details():
    gemma = AutoConfig.for_model(**hf_config_dict(resolve_model("Gemma-2-27B")))
    assert (gemma.head_dim, gemma.query_pre_attn_scalar, gemma.final_logit_softcapping) == (128, 144, 30.0)
    llama = AutoConfig.for_model(**hf_config_dict(resolve_model("Llama-3.1-8B")))
    assert llama.rope_parameters["rope_type"] == "llama3"
    assert llama.rope_parameters["rope_theta"] == 500000.0


# --- GPUs ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("H100", "H100-80GB"),
        ("h100-sxm", "H100-80GB"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),  # torch.cuda.get_device_name()
        ("H100-PCIe", "H100-PCIe-80GB"),
        ("h200", "H200-141GB"),
        ("H20", "H20-96GB"),
        ("A100", "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("l40s", "L40S"),
        ("a10g", "A10G"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("rtx4090", "RTX-4090"),
        ("b200", "B200"),
    ],
)
def test_resolve_gpu(name, expected):
    assert resolve_gpu(name).name == expected


def test_gpu_figures():
    h100 = resolve_gpu("H100")
    assert h100.memory_bytes == 81089 * 2**20 and h100.bf16_tflops == 989
    assert (h100.interconnect, h100.gpus_per_node) == ("NVLink", 8)
    assert resolve_gpu("A10G").gpus_per_node == 4
    assert resolve_gpu("L40S").interconnect == "PCIe"
    # torch's total is 90-100% of the GiB in the marketing name (ECC and reservations take the rest).
    nominal_gib = {
        "H100-80GB": 80,
        "H100-PCIe-80GB": 80,
        "H200-141GB": 141,
        "H20-96GB": 96,
        "A100-40GB": 40,
        "A100-80GB": 80,
        "L40S": 48,
        "A10G": 24,
        "RTX-4090": 24,
        "B200": 192,
        "A800-80GB": 80,
        "H800-80GB": 80,
        "H100-96GB": 96,
        "RTX-A6000": 48,
        "L4": 24,
    }
    assert sorted(nominal_gib) == sorted(g.name for g in list_gpus())
    for gpu in list_gpus():
        assert 0.9 <= gpu.memory_bytes / (nominal_gib[gpu.name] * 2**30) <= 1.0, gpu.name


def test_unknown_gpu_lists_the_catalog():
    with pytest.raises(UserError, match=r"unknown GPU 'H10'.*did you mean.*H100.*known GPUs: H100-80GB, "):
        resolve_gpu("H10")


# --- packaging and docs --------------------------------------------------------------------------


def test_catalog_imports_no_torch():
    code = "import sys, rlctl.catalog\nprint(any(m.split('.')[0] in ('torch', 'transformers') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


def test_docs_are_generated_from_the_catalog():
    doc = (REPO / "docs" / "catalog.md").read_text()
    assert doc == catalog_markdown(), "regenerate: python -m rlctl.catalog > docs/catalog.md"
    assert "| Qwen2.5-7B | `Qwen/Qwen2.5-7B` | qwen2 | 7,615,616,512 |" in doc
