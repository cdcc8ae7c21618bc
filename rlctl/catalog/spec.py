"""The two records the catalogs hold: a model architecture and a GPU type.

Everything the planner and the estimator know about a model or a GPU comes from these fields,
so they must be enough to count parameters, activations and KV cache exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelSpec:
    name: str  # canonical catalog name, e.g. "Qwen2.5-7B"
    hf_id: str  # e.g. "Qwen/Qwen2.5-7B"
    arch: str  # transformers model_type: qwen2, qwen3, qwen3_moe, llama, mistral, gemma2, deepseek_v3
    hidden_size: int
    intermediate_size: int  # dense MLP width (for MoE models: the dense layers' width)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v (MLA: on q_a_proj and kv_a_proj_with_mqa)
    o_bias: bool = False  # bias on the attention output projection
    mlp_bias: bool = False  # bias on gate/up/down (Llama's mlp_bias)
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    max_position: int = 32768
    rope_theta: float = 10000.0
    # MoE (0 experts = dense)
    num_experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    expert_intermediate_size: int = 0
    first_dense_layers: int = 0  # DeepSeek: the first k layers are dense
    # MLA (DeepSeek); 0 = standard attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    mtp_layers: int = 0  # DeepSeek-V3 multi-token-prediction modules (not counted by transformers)
    source: str = "catalog"  # "catalog" or the local path it was read from
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0


@dataclass(frozen=True)
class GpuSpec:
    name: str  # canonical, e.g. "H100-80GB"
    memory_bytes: int  # total device memory as torch reports it (get_device_properties().total_memory)
    bf16_tflops: float  # dense bf16 peak
    interconnect: str  # "NVLink" or "PCIe"
    interconnect_gbps: float  # per-GPU bandwidth, GB/s
    gpus_per_node: int
    aliases: tuple[str, ...] = ()
    # host (CPU) memory of one typical cloud node of ``gpus_per_node`` GPUs; 0 = unknown (not checked)
    host_memory_bytes: int = 0
