"""The two records the catalogs hold: a model architecture and a GPU type.

Everything the planner and the estimator know about a model or a GPU comes from these fields,
so they must be enough to count parameters, activations and KV cache exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class VisionSpec:
    """The vision tower of a vision-language model (Qwen2-VL, Qwen2.5-VL) and its processor's defaults.

    A ``temporal_patch_size x patch_size x patch_size`` patch of pixels is one row through the tower's
    ``depth`` blocks; the merger folds each ``spatial_merge_size x spatial_merge_size`` group of patches into
    one token of the text model's width (``out_hidden_size``), placed where the prompt's image tokens are.
    """

    arch: str  # the model_type: qwen2_vl (LayerNorm, fc1/fc2 MLP) | qwen2_5_vl (RMSNorm, gated MLP)
    depth: int  # vision blocks
    hidden_size: int  # the tower's width (Qwen2-VL's embed_dim)
    intermediate_size: int  # the blocks' MLP width (Qwen2-VL: embed_dim x mlp_ratio)
    num_heads: int
    out_hidden_size: int  # the merger's output width: the text model's hidden size
    patch_size: int = 14
    temporal_patch_size: int = 2  # an image is its own frame repeated: one patch row per spatial patch
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 0  # Qwen2.5-VL: windowed attention over this many pixels (0: every block attends globally)
    fullatt_block_indexes: tuple[int, ...] = ()  # Qwen2.5-VL: the blocks that attend over the whole image
    # the image processor's defaults (preprocessor_config.json): an image is resized to within these pixel counts
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @property
    def patch_values(self) -> int:
        """Input values of one patch row: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    def patches(self, pixels: int) -> int:
        """Patch rows of one image of at most ``pixels`` pixels (the processor resizes to multiples of
        patch x merge, so a count of whole merge groups)."""
        group = (self.patch_size * self.spatial_merge_size) ** 2
        groups = max(1, max(min(pixels, self.max_pixels), self.min_pixels) // group)
        return groups * self.spatial_merge_size**2

    def image_tokens(self, pixels: int) -> int:
        """Tokens one image adds to the text sequence: its patches merged."""
        return self.patches(pixels) // self.spatial_merge_size**2


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
    vision: VisionSpec | None = None  # a vision-language model's vision tower (the fields above: its text model)
    source: str = "catalog"  # "catalog" or the local path it was read from
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def uses_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_vl(self) -> bool:
        return self.vision is not None


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
