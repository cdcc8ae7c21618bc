"""Closed-form parameter counts, equal to what transformers builds for a ModelSpec.

The counts follow the modules transformers instantiates (``sum(p.numel() for p in
model.parameters())``, tied weights once):

- embeddings: ``vocab x hidden``; the lm_head adds as much again unless tied.
- attention: q/k/v/o projections with their optional biases and Qwen3's per-head q/k RMSNorms; for
  MLA (DeepSeek) the low-rank q and kv projections and their RMSNorms.
- MLP: gated (gate, up, down). A MoE layer holds the routed experts, the router (a bias-free
  ``experts x hidden`` matrix) and DeepSeek's shared experts. DeepSeek's ``e_score_correction_bias``
  is a buffer in transformers, not a parameter, so it is not counted.
- norms: two RMSNorms per layer (four for Gemma-2) and the final norm.
- DeepSeek-V3's multi-token-prediction module is not built by transformers and is not counted
  (``spec.mtp_layers`` records it).
- a vision-language model adds its vision tower (``model.visual``): the patch embedding (a bias-free
  Conv3d), the blocks (two norms, fused qkv and proj with biases, the MLP with biases) and the merger
  (a norm and two biased linears from ``merge^2 x width`` to the text width). Qwen2-VL's norms are
  LayerNorms (weight and bias) and its MLP is fc1/fc2; Qwen2.5-VL's are RMSNorms and a gated MLP.
  The rotary tables are buffers, not parameters.
"""

from __future__ import annotations

from .spec import ModelSpec, VisionSpec


def embedding_params(spec: ModelSpec) -> int:
    """The input embedding matrix (the lm_head is counted separately unless tied)."""
    return spec.vocab_size * spec.hidden_size


def lm_head_params(spec: ModelSpec) -> int:
    """The output projection; 0 when it shares the input embedding."""
    return 0 if spec.tie_embeddings else spec.vocab_size * spec.hidden_size


def attention_params(spec: ModelSpec) -> int:
    """One layer's attention block (projections, biases, q/k norms)."""
    h, heads = spec.hidden_size, spec.num_heads
    if spec.uses_mla:
        qk_dim = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        if spec.q_lora_rank:
            r = spec.q_lora_rank
            q = h * r + (r if spec.qkv_bias else 0) + r + r * heads * qk_dim  # q_a, bias, norm, q_b
        else:
            q = h * heads * qk_dim
        kv_a = spec.kv_lora_rank + spec.qk_rope_head_dim
        kv = h * kv_a + (kv_a if spec.qkv_bias else 0) + spec.kv_lora_rank  # kv_a, bias, norm
        kv += spec.kv_lora_rank * heads * (spec.qk_nope_head_dim + spec.v_head_dim)  # kv_b
        o = heads * spec.v_head_dim * h + (h if spec.o_bias else 0)
        return q + kv + o
    q_out = heads * spec.head_dim
    kv_out = spec.num_kv_heads * spec.head_dim
    params = h * (q_out + 2 * kv_out) + q_out * h
    if spec.qkv_bias:
        params += q_out + 2 * kv_out
    if spec.o_bias:
        params += h
    if spec.qk_norm:
        params += 2 * spec.head_dim
    return params


def dense_mlp_params(spec: ModelSpec, width: int | None = None) -> int:
    """A gated MLP (gate, up, down) of the given width (default: the dense width)."""
    f = spec.intermediate_size if width is None else width
    params = 3 * spec.hidden_size * f
    if spec.mlp_bias:
        params += 2 * f + spec.hidden_size
    return params


def moe_mlp_params(spec: ModelSpec) -> int:
    """A MoE block: routed experts, router and shared experts."""
    experts = spec.num_experts * dense_mlp_params(spec, spec.expert_intermediate_size)
    router = spec.num_experts * spec.hidden_size
    shared = dense_mlp_params(spec, spec.expert_intermediate_size * spec.shared_experts) if spec.shared_experts else 0
    return experts + router + shared


def norms_per_layer(spec: ModelSpec) -> int:
    """RMSNorm weights in one decoder layer (Gemma-2 adds pre/post feed-forward norms)."""
    return (4 if spec.arch == "gemma2" else 2) * spec.hidden_size


def num_moe_layers(spec: ModelSpec) -> int:
    return spec.num_layers - spec.first_dense_layers if spec.is_moe else 0


def num_dense_layers(spec: ModelSpec) -> int:
    return spec.num_layers - num_moe_layers(spec)


def dense_layer_params(spec: ModelSpec) -> int:
    return attention_params(spec) + dense_mlp_params(spec) + norms_per_layer(spec)


def moe_layer_params(spec: ModelSpec) -> int:
    return attention_params(spec) + moe_mlp_params(spec) + norms_per_layer(spec)


def layer_params(spec: ModelSpec) -> int:
    """Parameters of the largest decoder layer (what FSDP gathers at once)."""
    sizes = []
    if num_dense_layers(spec):
        sizes.append(dense_layer_params(spec))
    if num_moe_layers(spec):
        sizes.append(moe_layer_params(spec))
    return max(sizes)


def text_params(spec: ModelSpec) -> int:
    """The language model: embeddings, decoder layers, final norm and output head (tied weights once, no MTP)."""
    layers = num_dense_layers(spec) * dense_layer_params(spec)
    layers += num_moe_layers(spec) * moe_layer_params(spec)
    final_norm = spec.hidden_size
    return embedding_params(spec) + layers + final_norm + lm_head_params(spec)


def _vision_norm(v: VisionSpec, width: int) -> int:
    return (1 if v.arch == "qwen2_5_vl" else 2) * width  # RMSNorm: weight; LayerNorm: weight and bias


def vision_block_params(v: VisionSpec) -> int:
    """One vision block: two norms, qkv and proj (with biases), the MLP (with biases)."""
    w, f = v.hidden_size, v.intermediate_size
    attention = 4 * w * w + 4 * w
    mlp = (3 * w * f + 2 * f + w) if v.arch == "qwen2_5_vl" else (2 * w * f + f + w)
    return 2 * _vision_norm(v, w) + attention + mlp


def vision_merger_params(v: VisionSpec) -> int:
    """The patch merger: a norm over the tower's width, then Linear(m, m) and Linear(m, out), m = merge^2 x width."""
    m = v.hidden_size * v.spatial_merge_size**2
    return _vision_norm(v, v.hidden_size) + m * m + m + m * v.out_hidden_size + v.out_hidden_size


def vision_params(spec: ModelSpec) -> int:
    """The whole vision tower (patch embedding, blocks, merger); 0 for a text model."""
    v = spec.vision
    if v is None:
        return 0
    patch_embed = v.patch_values * v.hidden_size  # Conv3d without bias
    return patch_embed + v.depth * vision_block_params(v) + vision_merger_params(v)


def count_params(spec: ModelSpec) -> int:
    """Total parameters, exactly as transformers counts them (tied weights once, no MTP, the vision tower)."""
    return text_params(spec) + vision_params(spec)


def active_params(spec: ModelSpec) -> int:
    """Parameters used per token: for MoE only ``experts_per_token`` routed experts count.

    Embeddings and the lm_head are included (the convention behind "Qwen3-30B-A3B: 3.3B
    activated" and "DeepSeek-V3: 37B activated"). Equals count_params for dense models.
    """
    idle = spec.num_experts - spec.experts_per_token
    idle_per_layer = idle * dense_mlp_params(spec, spec.expert_intermediate_size)
    return count_params(spec) - num_moe_layers(spec) * idle_per_layer


def kv_cache_bytes_per_token(spec: ModelSpec, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token over all layers, as vLLM/SGLang store it.

    Standard attention keeps K and V: ``2 * layers * kv_heads * head_dim``. MLA keeps the
    compressed latent and the shared rope key: ``layers * (kv_lora_rank + qk_rope_head_dim)``
    (transformers' own cache stores the expanded per-head K and V instead, which is far larger).
    """
    if spec.uses_mla:
        per_layer = spec.kv_lora_rank + spec.qk_rope_head_dim
    else:
        per_layer = 2 * spec.num_kv_heads * spec.head_dim
    return spec.num_layers * per_layer * dtype_bytes
