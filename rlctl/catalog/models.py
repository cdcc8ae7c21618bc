"""The model catalog and name resolution.

Every entry copies the architecture fields of the model's published config.json (the base
repository; the -Instruct/-it variants share the architecture). ``max_position`` is the
config's ``max_position_embeddings``. Fields transformers needs to rebuild the model faithfully
but that counting does not use (rope scaling, norm eps, Gemma-2's soft-capping...) live in
``spec.extra`` and are passed through by :func:`rlctl.catalog.hf_config.hf_config_dict`.

No torch/transformers import here: the CLI uses this module for completion and --help.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from ..errors import UserError, did_you_mean
from .hf_config import spec_from_path
from .spec import ModelSpec, VisionSpec

# --- catalog ----------------------------------------------------------------------------------

_QWEN25_EXTRA = {"rms_norm_eps": 1e-6, "hidden_act": "silu"}


def _qwen25(size, hidden, inter, layers, heads, kv, vocab, tied) -> ModelSpec:
    return ModelSpec(
        name=f"Qwen2.5-{size}",
        hf_id=f"Qwen/Qwen2.5-{size}",
        arch="qwen2",
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=hidden // heads,
        vocab_size=vocab,
        tie_embeddings=tied,
        qkv_bias=True,
        max_position=32768 if size in ("0.5B", "1.5B", "3B") else 131072,
        rope_theta=1e6,
        extra=dict(_QWEN25_EXTRA),
    )


def _qwen3(size, hidden, inter, layers, heads, kv, tied) -> ModelSpec:
    return ModelSpec(
        name=f"Qwen3-{size}",
        hf_id=f"Qwen/Qwen3-{size}",
        arch="qwen3",
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=128,
        vocab_size=151936,
        tie_embeddings=tied,
        qk_norm=True,
        max_position=40960,
        rope_theta=1e6,
        extra={"rms_norm_eps": 1e-6, "hidden_act": "silu"},
    )


def _llama(name, hidden, inter, layers, heads, tied, rope_factor) -> ModelSpec:
    rope_scaling = {
        "rope_type": "llama3",
        "factor": rope_factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return ModelSpec(
        name=name,
        hf_id=f"meta-llama/{name}",
        arch="llama",
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=hidden // heads,
        vocab_size=128256,
        tie_embeddings=tied,
        max_position=131072,
        rope_theta=500000.0,
        extra={"rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_scaling": rope_scaling},
    )


def _gemma2(size, hidden, inter, layers, heads, kv, head_dim, query_scalar) -> ModelSpec:
    return ModelSpec(
        name=f"Gemma-2-{size}",
        hf_id=f"google/gemma-2-{size.lower()}",
        arch="gemma2",
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=256000,
        tie_embeddings=True,
        max_position=8192,
        rope_theta=10000.0,
        extra={
            "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": query_scalar,
            "sliding_window": 4096,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
        },
    )


# Vision-language models: the text fields and vision_config of the published config.json of
# Qwen/Qwen2-VL-{2B,7B,72B}-Instruct and Qwen/Qwen2.5-VL-{3B,7B,32B,72B}-Instruct on huggingface.co
# (Qwen2-VL's vision_config gives embed_dim 1280, depth 32, 16 heads, mlp_ratio 4, patch 14, merge 2 and
# its "hidden_size" is the text width; Qwen2.5-VL's gives hidden_size 1280, depth 32, 16 heads, window 112,
# full attention in blocks 7/15/23/31, intermediate_size 3420 (3B, 7B) or 3456 (32B, 72B) and
# out_hidden_size = the text width). The totals match the parameter counts Hugging Face shows for the
# safetensors (2.21B, 8.29B, 3.75B, 8.29B, 73.4B); the AWQ/GPTQ copies pad the 72B MLP to 29696.
# The processor's default max_pixels is 28 x 28 x 1280 (1280 image tokens) for both families.


def _qwen_vl(name, family, hidden, inter, layers, heads, kv, vocab, tied, vision_inter=0) -> ModelSpec:
    v25 = family == "qwen2_5_vl"
    vision = VisionSpec(
        arch=family,
        depth=32,
        hidden_size=1280,
        intermediate_size=vision_inter if v25 else 4 * 1280,
        num_heads=16,
        out_hidden_size=hidden,
        window_size=112 if v25 else 0,
        fullatt_block_indexes=(7, 15, 23, 31) if v25 else (),
    )
    text = _qwen25(name, hidden, inter, layers, heads, kv, vocab, tied)  # the language model: Qwen2.5's layout
    return dataclasses.replace(
        text,
        name=name,
        hf_id=f"Qwen/{name}-Instruct",
        arch=family,
        max_position=128000 if v25 else 32768,
        vision=vision,
        extra={
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        },
    )


_MODELS: tuple[ModelSpec, ...] = (
    _qwen25("0.5B", 896, 4864, 24, 14, 2, 151936, True),
    _qwen25("1.5B", 1536, 8960, 28, 12, 2, 151936, True),
    _qwen25("3B", 2048, 11008, 36, 16, 2, 151936, True),
    _qwen25("7B", 3584, 18944, 28, 28, 4, 152064, False),
    _qwen25("14B", 5120, 13824, 48, 40, 8, 152064, False),
    _qwen25("32B", 5120, 27648, 64, 40, 8, 152064, False),
    _qwen25("72B", 8192, 29568, 80, 64, 8, 152064, False),
    _qwen3("0.6B", 1024, 3072, 28, 16, 8, True),
    _qwen3("1.7B", 2048, 6144, 28, 16, 8, True),
    _qwen3("4B", 2560, 9728, 36, 32, 8, True),
    _qwen3("8B", 4096, 12288, 36, 32, 8, False),
    _qwen3("14B", 5120, 17408, 40, 40, 8, False),
    _qwen3("32B", 5120, 25600, 64, 64, 8, False),
    ModelSpec(
        name="Qwen3-30B-A3B",
        hf_id="Qwen/Qwen3-30B-A3B",
        arch="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=151936,
        qk_norm=True,
        max_position=40960,
        rope_theta=1e6,
        num_experts=128,
        experts_per_token=8,
        expert_intermediate_size=768,
        extra={
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
    ),
    _llama("Llama-3.2-1B", 2048, 8192, 16, 32, True, 32.0),
    _llama("Llama-3.2-3B", 3072, 8192, 28, 24, True, 32.0),
    _llama("Llama-3.1-8B", 4096, 14336, 32, 32, False, 8.0),
    _llama("Llama-3.1-70B", 8192, 28672, 80, 64, False, 8.0),
    _llama("Llama-3.1-405B", 16384, 53248, 126, 128, False, 8.0),
    ModelSpec(
        name="Mistral-7B",
        hf_id="mistralai/Mistral-7B-v0.3",
        arch="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=32768,
        max_position=32768,
        rope_theta=1e6,
        extra={"rms_norm_eps": 1e-5, "hidden_act": "silu", "sliding_window": None},
    ),
    _gemma2("2B", 2304, 9216, 26, 8, 4, 256, 256),
    _gemma2("9B", 3584, 14336, 42, 16, 8, 256, 256),
    _gemma2("27B", 4608, 36864, 46, 32, 16, 128, 144),
    _qwen_vl("Qwen2-VL-2B", "qwen2_vl", 1536, 8960, 28, 12, 2, 151936, True),
    _qwen_vl("Qwen2-VL-7B", "qwen2_vl", 3584, 18944, 28, 28, 4, 152064, False),
    _qwen_vl("Qwen2-VL-72B", "qwen2_vl", 8192, 29568, 80, 64, 8, 152064, False),
    _qwen_vl("Qwen2.5-VL-3B", "qwen2_5_vl", 2048, 11008, 36, 16, 2, 151936, True, 3420),
    _qwen_vl("Qwen2.5-VL-7B", "qwen2_5_vl", 3584, 18944, 28, 28, 4, 152064, False, 3420),
    _qwen_vl("Qwen2.5-VL-32B", "qwen2_5_vl", 5120, 27648, 64, 40, 8, 152064, False, 3456),
    _qwen_vl("Qwen2.5-VL-72B", "qwen2_5_vl", 8192, 29568, 80, 64, 8, 152064, False, 3456),
    ModelSpec(
        name="DeepSeek-V3",
        hf_id="deepseek-ai/DeepSeek-V3",
        arch="deepseek_v3",
        hidden_size=7168,
        intermediate_size=18432,
        num_layers=61,
        num_heads=128,
        num_kv_heads=128,
        head_dim=192,
        vocab_size=129280,
        max_position=163840,
        rope_theta=10000.0,
        num_experts=256,
        experts_per_token=8,
        shared_experts=1,
        expert_intermediate_size=2048,
        first_dense_layers=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mtp_layers=1,
        extra={
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "n_group": 8,
            "topk_group": 4,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        },
    ),
)

# Other published names for the same architecture (normalised like everything else).
_ALIASES = {
    "mistral-7b-v0.3": "Mistral-7B",
    "meta-llama-3.1-8b": "Llama-3.1-8B",
    "meta-llama-3.1-70b": "Llama-3.1-70B",
    "meta-llama-3.1-405b": "Llama-3.1-405B",
    "deepseek-v3-0324": "DeepSeek-V3",
}

# Variant words that do not change the architecture: Qwen2.5-7B-Instruct, gemma-2-9b-it,
# Mistral-7B-Instruct-v0.3, DeepSeek-V3-Base.
_VARIANT_WORDS = {"instruct", "chat", "base", "it"}


def _normalize(name: str) -> str:
    name = name.strip().lower().rsplit("/", 1)[-1]
    parts = [p for p in re.split(r"[-_\s]+", name) if p and p not in _VARIANT_WORDS]
    return "-".join(parts)


def _index() -> dict[str, ModelSpec]:
    by_key = {}
    for spec in _MODELS:
        by_key[_normalize(spec.name)] = spec
        by_key[_normalize(spec.hf_id)] = spec
    for alias, name in _ALIASES.items():
        by_key[_normalize(alias)] = next(s for s in _MODELS if s.name == name)
    return by_key


def list_models() -> list[ModelSpec]:
    """Catalog entries, in catalog order (families, then size)."""
    return list(_MODELS)


def resolve_model(name_or_path: str) -> ModelSpec:
    """A catalog name or HF id (any case, org optional, -Instruct/-Chat/-Base/-it ok), a local
    HF model directory, or a config.json path."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".json"):
        return spec_from_path(name_or_path)  # named as typed
    if name_or_path.startswith(("/", "./", "../", "~")):
        raise UserError(f"{name_or_path} does not exist; pass a HF model directory or a catalog name")
    spec = _index().get(_normalize(name_or_path))
    if spec is not None:
        return spec
    names = [s.name for s in _MODELS]
    hint = did_you_mean(_normalize(name_or_path), names) or f" (catalog: {', '.join(names[:6])}, ...)"
    raise UserError(
        f"unknown model '{name_or_path}'{hint}; pass a catalog name (see `docs/catalog.md`) "
        "or a local HF model directory"
    )
