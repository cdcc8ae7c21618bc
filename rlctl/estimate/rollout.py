"""The rollout phase: the inference engine's weights, KV cache and transient activations on one GPU."""

from __future__ import annotations

import math

from rlctl.catalog.gpus import vllm_batch_limits
from rlctl.catalog.spec import GpuSpec, ModelSpec
from rlctl.estimate.result import MemoryEstimate
from rlctl.estimate.settings import (
    ENGINE_BATCHED_TOKENS,
    ENGINE_GRAPH_BYTES,
    ENGINE_MAX_SEQS,
    MemorySettings,
)
from rlctl.estimate.training import count_params, vision_block_values


def kv_bytes_per_token(spec: ModelSpec, rollout_tp: int, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token on one GPU of an engine with tensor parallelism ``rollout_tp``.

    ``2 L kv_heads head_dim`` values, the KV heads split over TP (replicated when TP exceeds
    them); MLA caches one ``kv_lora_rank + rope`` latent per layer, replicated on every TP rank.
    """
    if spec.uses_mla:
        return spec.num_layers * (spec.kv_lora_rank + spec.qk_rope_head_dim) * dtype_bytes
    heads = math.ceil(spec.num_kv_heads / rollout_tp)
    return 2 * spec.num_layers * heads * spec.head_dim * dtype_bytes


def engine_activation_bytes(spec: ModelSpec, tokens: int, sequences: int, rollout_tp: int, dtype_bytes: int) -> int:
    """The engine's largest transient: one forward over ``tokens`` tokens (residual and norm,
    QKV, the gated MLP's gate/up and activation) and fp32 logits for ``sequences`` samples."""
    h = spec.hidden_size
    if spec.uses_mla:
        qkv = spec.num_heads * (2 * (spec.qk_nope_head_dim + spec.qk_rope_head_dim) + spec.v_head_dim)
    else:
        qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    if spec.is_moe:
        f = spec.expert_intermediate_size * (spec.experts_per_token + spec.shared_experts)
    else:
        f = spec.intermediate_size
    per_token = 2 * h + math.ceil((qkv + 3 * f) / rollout_tp)
    return tokens * per_token * dtype_bytes + sequences * math.ceil(spec.vocab_size / rollout_tp) * 4


def engine_vision_bytes(spec: ModelSpec, s: MemorySettings, merged_tokens: int) -> int:
    """A VL engine's vision encoder over the images of one step (``merged_tokens`` image tokens' patches):
    one block's values at a time, inference keeps nothing for a backward."""
    v = spec.vision
    if v is None or not s.image_tokens:
        return 0
    patches = max(merged_tokens, s.image_tokens) * v.spatial_merge_size**2
    return patches * (v.hidden_size + vision_block_values(v)) * s.compute_bytes


def engine_phase(model: ModelSpec, gpu: GpuSpec, s: MemorySettings, est: MemoryEstimate) -> dict[str, int]:
    """The rollout engine's share of one GPU; fills the estimate's KV-cache fields."""
    rtp = s.rollout_tp
    eb = s.compute_bytes  # engines run in the compute dtype (bf16 on GPUs)
    weights = math.ceil(eb * count_params(model) / rtp)
    per_token = kv_bytes_per_token(model, rtp, eb)
    replicas = (s.rollout_procs or s.gpus) // rtp  # a split run's engines are on its rollout devices
    batch_sequences = math.ceil(s.rollout_batch * s.rollout_n / replicas)
    seq = s.prompt_tokens + s.response_len
    if s.rollout == "hf" or s.device == "cpu":
        # the hf engine's fast decode step preallocates the cache for the whole batch and its longest
        # sequence (what vLLM-CPU grows to as well); prefill is the transient peak
        kv = batch_sequences * seq * per_token
        act = engine_activation_bytes(model, batch_sequences * s.prompt_tokens, batch_sequences, rtp, eb)
        # the images of the engine's prompts, once each (the group of a prompt shares them)
        prompts = math.ceil(s.rollout_batch / replicas)
        act = max(act, engine_vision_bytes(model, s, prompts * s.image_tokens))
        parts = {"engine_weights": weights, "kv_cache": kv, "engine_activations": act}
        if s.rollout == "hf" and s.device == "cpu" and eb == 4:
            # fp32 on CPU: the fast decode step keeps a oneDNN-prepacked copy of every large weight
            # (rlctl.rollout.hf_decode); counted as the whole model, an upper bound by the embedding
            parts["engine_packed_weights"] = weights
    else:
        # the fraction is of the GPU's whole memory for both engines (rlctl's SGLang adapter converts it
        # to SGLang's share of the memory free when it starts, rlctl.rollout.sglang)
        budget = int(s.mem_fraction * gpu.memory_bytes)
        if s.rollout == "vllm":  # gpu_memory_utilization covers weights, activations and the cache
            tokens, seqs = vllm_batch_limits(gpu.memory_bytes, gpu.name)
            act = max(engine_activation_bytes(model, tokens, seqs, rtp, eb), engine_vision_bytes(model, s, tokens))
            kv = budget - weights - act
        else:  # sglang's mem_fraction_static covers weights and the KV pool; activations come on top
            act = engine_activation_bytes(model, ENGINE_BATCHED_TOKENS, ENGINE_MAX_SEQS, rtp, eb)
            act = max(act, engine_vision_bytes(model, s, ENGINE_BATCHED_TOKENS))
            kv = budget - weights
        parts = {
            "engine_weights": weights,
            "kv_cache": max(kv, 0),
            "engine_activations": act,
            "cuda_graphs": ENGINE_GRAPH_BYTES,
        }
    est.kv_bytes_per_token = per_token
    est.kv_cache_bytes = parts["kv_cache"]
    est.kv_cache_tokens = parts["kv_cache"] // per_token
    est.kv_cache_sequences = est.kv_cache_tokens // seq
    return parts
