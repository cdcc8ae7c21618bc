"""A model's transformers config.json, both ways: a local HF model directory or a config.json dict ->
:class:`ModelSpec` (the architectures in :data:`SUPPORTED_ARCHS`), and a spec -> the config.json dict
that builds it (:func:`hf_config_dict`).

No torch/transformers import here: the CLI uses this module for completion and --help.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import UserError
from .spec import ModelSpec, VisionSpec

# --- config.json -> ModelSpec -------------------------------------------------------------------

# model_type -> the CausalLM class transformers builds for it
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
VL_ARCHS = ("qwen2_vl", "qwen2_5_vl")  # their text model is Qwen2's (q/k/v biases), with multimodal rope
SUPPORTED_ARCHS = tuple(_ARCHITECTURES)

# head_dim when config.json does not give one: transformers' class default where it has one.
_HEAD_DIM_DEFAULT = {"qwen3": 128, "gemma2": 256}
_TIED_DEFAULT = {"gemma2": True}
# Keys copied into spec.extra so hf_config_dict can rebuild the same config.
_EXTRA_KEYS = (
    "rms_norm_eps",
    "hidden_act",
    "hidden_activation",
    "rope_scaling",
    "rope_parameters",
    "sliding_window",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "scoring_func",
    "topk_method",
)


def spec_from_path(path: str | Path) -> ModelSpec:
    """Read a local HF model directory (its config.json) or a config.json file. The spec is named by the
    path as given (messages name what the user typed, not the directory's last component)."""
    typed = str(path)
    path = Path(path).expanduser()
    config_path = path / "config.json" if path.is_dir() else path
    if not config_path.is_file():
        raise UserError(f"{path} has no config.json; pass a HF model directory or a catalog name")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {config_path}: {e}; is it a transformers config.json?") from e
    processor = {}
    preprocessor = config_path.parent / "preprocessor_config.json"
    if config.get("model_type") in VL_ARCHS and preprocessor.is_file():
        try:
            processor = json.loads(preprocessor.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"cannot read {preprocessor}: {e}; is it a transformers preprocessor_config.json?") from e
    return spec_from_hf_config(config, source=str(path), name=typed, processor=processor)


def spec_from_hf_config(config: dict, *, source: str, name: str, processor: dict | None = None) -> ModelSpec:
    """Map a transformers config.json dict onto a ModelSpec (the architectures in SUPPORTED_ARCHS); a VL
    model's ``processor`` (its preprocessor_config.json) gives the pixel bounds of an image."""
    arch = config.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise UserError(f"{source}: model_type '{arch}' is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
    vision = None
    if arch in VL_ARCHS:  # transformers >= 5 nests the text fields in text_config; published files keep them flat
        vision = _vision_from_config(arch, config.get("vision_config") or {}, processor or {})
        config = {**config, **(config.get("text_config") or {}), "model_type": arch}

    def need(key: str, *alternatives: str):
        for k in (key, *alternatives):
            if config.get(k) is not None:
                return config[k]
        raise UserError(f"{source}: config.json has no '{key}'; is it a complete {arch} config?")

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    rope = config.get("rope_parameters") or {}  # transformers >= 5 writes rope_theta here
    attention_bias = bool(config.get("attention_bias", False))
    fields = dict(
        name=name,
        hf_id=config.get("_name_or_path") or source,
        arch=arch,
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or _HEAD_DIM_DEFAULT.get(arch, hidden // heads),
        vocab_size=need("vocab_size"),
        tie_embeddings=bool(config.get("tie_word_embeddings", _TIED_DEFAULT.get(arch, False))),
        qkv_bias=arch in ("qwen2", *VL_ARCHS) or (attention_bias and arch != "mistral"),
        o_bias=attention_bias and arch not in ("qwen2", "mistral", *VL_ARCHS),
        mlp_bias=arch == "llama" and bool(config.get("mlp_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        max_position=config.get("max_position_embeddings") or 32768,
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        source=source,
        vision=vision,
        extra={k: config[k] for k in _EXTRA_KEYS if k in config},
    )
    if arch == "qwen3_moe":
        fields.update(_qwen3_moe_fields(config, need, source))
    if arch == "deepseek_v3":
        fields.update(_deepseek_v3_fields(config, need))
    return ModelSpec(**fields)


def _qwen3_moe_fields(config: dict, need: Callable[..., Any], source: str) -> dict:
    """The expert fields of a qwen3_moe config, whose every layer must be MoE."""
    if config.get("decoder_sparse_step", 1) != 1 or config.get("mlp_only_layers"):
        raise UserError(
            f"{source}: qwen3_moe with decoder_sparse_step != 1 or mlp_only_layers is not "
            "supported (every layer must be MoE)"
        )
    return dict(
        num_experts=need("num_experts", "num_local_experts"),  # transformers 5 saves the latter
        experts_per_token=need("num_experts_per_tok"),
        expert_intermediate_size=need("moe_intermediate_size"),
    )


def _deepseek_v3_fields(config: dict, need: Callable[..., Any]) -> dict:
    """The expert and latent-attention (MLA) fields of a deepseek_v3 config."""
    nope, rope_dim = need("qk_nope_head_dim"), need("qk_rope_head_dim")
    return dict(
        head_dim=nope + rope_dim,
        num_experts=need("n_routed_experts"),
        experts_per_token=need("num_experts_per_tok"),
        shared_experts=config.get("n_shared_experts") or 0,
        expert_intermediate_size=need("moe_intermediate_size"),
        first_dense_layers=config.get("first_k_dense_replace") or 0,
        q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=need("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=need("v_head_dim"),
        mtp_layers=config.get("num_nextn_predict_layers") or 0,
    )


def _vision_from_config(arch: str, vc: dict, processor: dict) -> VisionSpec:
    """A vision_config dict (absent keys: transformers' defaults for the family) and the processor's pixel bounds."""
    size = processor.get("size") or {}
    pixels = {
        "min_pixels": processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56,
        "max_pixels": processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280,
    }
    common = dict(
        arch=arch,
        depth=vc.get("depth", 32),
        num_heads=vc.get("num_heads", 16),
        patch_size=vc.get("patch_size") or vc.get("spatial_patch_size") or 14,
        temporal_patch_size=vc.get("temporal_patch_size", 2),
        spatial_merge_size=vc.get("spatial_merge_size", 2),
        in_channels=vc.get("in_channels") or vc.get("in_chans") or 3,
        **pixels,
    )
    if arch == "qwen2_vl":
        width = vc.get("embed_dim", 1280)
        return VisionSpec(
            hidden_size=width,
            intermediate_size=int(width * vc.get("mlp_ratio", 4)),
            out_hidden_size=vc.get("hidden_size", 3584),
            **common,
        )
    return VisionSpec(
        hidden_size=vc.get("hidden_size", 3584),
        intermediate_size=vc.get("intermediate_size", 3420),
        out_hidden_size=vc.get("out_hidden_size", 3584),
        window_size=vc.get("window_size", 112),
        fullatt_block_indexes=tuple(vc.get("fullatt_block_indexes", (7, 15, 23, 31))),
        **common,
    )


def _vision_config(spec: ModelSpec) -> dict:
    """The vision_config of a VL spec, in the keys transformers reads."""
    v = spec.vision
    assert v is not None
    d = {
        "depth": v.depth,
        "num_heads": v.num_heads,
        "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size,
        "spatial_merge_size": v.spatial_merge_size,
        "in_channels": v.in_channels,
    }
    if v.arch == "qwen2_vl":
        return {
            **d,
            "embed_dim": v.hidden_size,
            "mlp_ratio": v.intermediate_size // v.hidden_size,
            "hidden_size": v.out_hidden_size,
        }
    return {
        **d,
        "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size,
        "out_hidden_size": v.out_hidden_size,
        "window_size": v.window_size,
        "fullatt_block_indexes": list(v.fullatt_block_indexes),
    }


# --- ModelSpec -> config.json -------------------------------------------------------------------


def hf_config_dict(spec: ModelSpec) -> dict:
    """A config.json dict for ``transformers.AutoConfig.for_model(**d)`` that builds this model."""
    d = {
        "model_type": spec.arch,
        "architectures": [_ARCHITECTURES[spec.arch]],
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": spec.tie_embeddings,
        "max_position_embeddings": spec.max_position,
        "rope_theta": spec.rope_theta,
    }
    if spec.arch != "deepseek_v3":  # DeepSeek derives its head dims from the MLA fields
        d["head_dim"] = spec.head_dim
    if spec.arch in ("qwen3", "qwen3_moe", "llama", "gemma2"):
        d["attention_bias"] = spec.qkv_bias
    if spec.arch == "llama":
        d["mlp_bias"] = spec.mlp_bias
    if spec.arch == "qwen3_moe":
        d.update(
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=spec.expert_intermediate_size,
        )
    if spec.arch == "deepseek_v3":
        d.update(
            attention_bias=spec.qkv_bias,
            n_routed_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            n_shared_experts=spec.shared_experts,
            moe_intermediate_size=spec.expert_intermediate_size,
            first_k_dense_replace=spec.first_dense_layers,
            q_lora_rank=spec.q_lora_rank or None,
            kv_lora_rank=spec.kv_lora_rank,
            qk_nope_head_dim=spec.qk_nope_head_dim,
            qk_rope_head_dim=spec.qk_rope_head_dim,
            v_head_dim=spec.v_head_dim,
            num_nextn_predict_layers=spec.mtp_layers,
        )
    if spec.vision is not None:
        d["vision_config"] = _vision_config(spec)
    d.update(copy.deepcopy(spec.extra))  # transformers edits nested dicts (rope_scaling) in place
    return d
