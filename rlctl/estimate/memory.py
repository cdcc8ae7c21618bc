"""Per-GPU memory of a whole post-training job, before it runs.

A colocated RL job (verl's hybrid engine, rlctl's default) runs two phases on the same GPUs:

- **training**: the policy's weights, gradients and AdamW states, FSDP's gathered layers, the
  activations and logits of one micro batch, the reference model, an idle critic (PPO);
- **rollout**: the inference engine's weights and KV cache, next to whatever the trainer leaves
  on the GPU (its weights and optimizer states unless offloaded; gradients are freed).

The peak of a GPU is the larger phase. SFT has the training phase only. Every formula, its source
and the published figures it was checked against are in docs/estimate.md; each estimate also lists
the assumptions it made. Units are bytes; "GiB" in messages is 2**30 bytes.

Offload is what the engines do. FSDP2 (rlctl's FSDP engine) offloads with ``CPUOffloadPolicy``:
either flag puts the sharded weights, gradients and optimizer states on the CPU for the whole run
(the optimizer steps there; only the gathered layers come to the GPU). Megatron's
``offload_optimizer`` is megatron-core's ``optimizer_cpu_offload``: the fp32 master weights, a
gradient copy and the AdamW states live on the CPU for the whole run and the optimizer steps there;
``offload_params`` moves the bf16 weights and the gradient buffer to the CPU *between* phases (while
the engine generates), like verl's ``param_offload``, which does not shrink the update.

Offloaded states need **host memory**: every estimate on GPUs also counts, per node, what its
processes keep in CPU memory (offloaded states, pinned by torch's caching host allocator in
power-of-two blocks; a sleeping vLLM engine's weights; rank 0's copy of the checkpoint while the
FSDP engine loads it; the processes themselves) against the node's host memory less a margin.

No torch import: the CLI estimates in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache

from rlctl.catalog import count_params as _count_params
from rlctl.catalog import layer_params as largest_layer_params
from rlctl.catalog.count import embedding_params, lm_head_params
from rlctl.catalog.spec import GpuSpec, ModelSpec
from rlctl.errors import UserError
from rlctl.estimate.inventory import (
    LayerParams,
    Tensor,
    expert_params,
    layer_kinds,
    lora_params,
    tensors,
)

GIB = 2**30
CUDA_CONTEXT_BYTES = 3 * GIB // 2  # CUDA context, cuBLAS workspaces, NCCL buffers, allocator slack
ENGINE_GRAPH_BYTES = GIB // 2  # CUDA graphs captured by vLLM / SGLang
ENGINE_BATCHED_TOKENS = 8192  # tokens per engine forward (vLLM's max_num_batched_tokens as verl sets it)
ENGINE_MAX_SEQS = 256  # sequences per engine step (vLLM's max_num_seqs default): the sampler's logits
ADAM_STATE_BYTES = 8  # AdamW m and v in fp32
LOGIT_EXTRA_BYTES = 8  # per logit beyond the compute-dtype output: an fp32 copy and its log-softmax/grad
HOST_PROCESS_BYTES = 4 * GIB  # host memory of one GPU process: Python, torch/CUDA/NCCL host allocations, data
HOST_MARGIN_FRACTION = 0.10  # host memory kept free: the OS, page cache, allocator slack
CHECKPOINT_BYTES = 2  # bytes per parameter of the HF checkpoint (bf16) that FSDP's rank 0 loads whole

METHODS = ("sft", "grpo", "ppo")
BACKENDS = ("fsdp", "megatron")
ENGINES = ("hf", "vllm", "sglang")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass
class MemorySettings:
    """Everything about a job that changes its memory (sizes are per the whole job unless noted)."""

    method: str = "grpo"  # sft | grpo | ppo
    gpus: int = 1  # devices in total (processes on CPU)
    nodes: int = 1
    device: str = "cuda"  # cuda | cpu (cpu: no CUDA context, engines size the KV cache for the batch)
    dtype: str = "bf16"  # compute dtype: bf16 | fp16 | fp32
    lora_rank: int = 0  # 0 = full fine-tuning
    lora_targets: str = "all-linear"
    prompt_len: int = 512  # RL: longest prompt
    response_len: int = 1024  # RL: longest response
    max_len: int = 2048  # SFT: sequence length
    micro_batch: int = 1  # sequences per GPU per forward
    rollout_n: int = 8  # samples per prompt
    rollout_batch: int = 32  # prompts per step (sizes the HF engine's batch and the KV target)
    activation_checkpointing: bool = True
    offload_params: bool = False
    offload_optimizer: bool = False
    host_memory_bytes: int = 0  # host memory of one node for the job; 0 = the GPU type's node, shared by the GPUs used
    backend: str = "fsdp"  # fsdp | megatron
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    rollout: str | None = "vllm"  # hf | vllm | sglang (ignored for sft)
    rollout_tp: int = 1
    mem_fraction: float = 0.5  # vLLM gpu_memory_utilization / SGLang mem_fraction_static
    kl: bool = True  # a reference model is kept (RL with a KL term)
    critic: bool | None = None  # None = PPO has one
    optimizer: str = "adamw"

    @property
    def is_rl(self) -> bool:
        return self.method != "sft"

    @property
    def has_critic(self) -> bool:
        return self.method == "ppo" if self.critic is None else self.critic

    @property
    def seq_len(self) -> int:
        """Tokens of one training sequence."""
        return self.prompt_len + self.response_len if self.is_rl else self.max_len

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len // self.cp

    @property
    def cpu_offload(self) -> bool:
        """FSDP2 CPU offload: sharded weights, gradients and optimizer states live on the CPU."""
        return self.device == "cuda" and self.backend == "fsdp" and (self.offload_params or self.offload_optimizer)

    @property
    def megatron_optimizer_offload(self) -> bool:
        """megatron-core's ``optimizer_cpu_offload``: fp32 master, gradient copy and AdamW states on the CPU."""
        return self.device == "cuda" and self.backend == "megatron" and self.offload_optimizer

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def idle_weights_offloaded(self) -> bool:
        """Weights (trainer, reference, critic) are off the GPU while their model is idle."""
        return self.cpu_offload or (self.backend == "megatron" and self.offload_params)

    @property
    def idle_optimizer_offloaded(self) -> bool:
        return self.cpu_offload or (self.backend == "megatron" and self.offload_optimizer)

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp * self.cp)

    def check(self, spec: ModelSpec) -> None:
        """Reject impossible settings with a one-line UserError."""
        choices = {"method": METHODS, "backend": BACKENDS, "dtype": tuple(DTYPE_BYTES), "device": ("cuda", "cpu")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise UserError(f"{key}={getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.is_rl and self.rollout not in ENGINES:
            raise UserError(f"rollout={self.rollout!r} is not one of {', '.join(ENGINES)}")
        if self.optimizer != "adamw":
            raise UserError(f"optimizer={self.optimizer!r}: the estimator models AdamW only")
        for key in ("gpus", "nodes", "micro_batch", "tp", "pp", "cp", "ep", "rollout_tp", "rollout_n", "rollout_batch"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be at least 1, got {getattr(self, key)}")
        if self.gpus % self.nodes:
            raise UserError(f"{self.gpus} GPUs do not split evenly over {self.nodes} nodes")
        if self.host_memory_bytes < 0:
            raise UserError(
                f"host_memory_bytes must be positive (0 = the GPU type's typical node), got {self.host_memory_bytes}"
            )
        if self.gpus % (self.tp * self.pp * self.cp):
            raise UserError(f"{self.gpus} GPUs do not split into tp {self.tp} x pp {self.pp} x cp {self.cp}")
        if self.backend == "fsdp" and (self.tp, self.pp, self.ep) != (1, 1, 1):
            raise UserError("the fsdp backend shards over every GPU: tp, pp and ep must be 1 (use megatron)")
        if self.pp > 1 and pipeline_split(spec.num_layers, self.pp) is None:
            raise UserError(f"pp {self.pp} cannot split {spec.num_layers} layers")
        if self.ep > 1 and (not spec.is_moe or spec.num_experts % self.ep or (self.gpus // self.pp) % self.ep):
            raise UserError(f"ep {self.ep} must divide the experts ({spec.num_experts}) and the GPUs per stage")
        if self.is_rl and self.gpus % self.rollout_tp:
            raise UserError(f"rollout tp {self.rollout_tp} must divide the {self.gpus} GPUs")
        if self.is_rl and self.rollout != "hf" and self.device == "cuda" and not 0 < self.mem_fraction < 1:
            raise UserError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")


@dataclass
class Phase:
    """One phase of the job on the busiest GPU: its memory by component."""

    components: dict[str, int]
    note: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    def to_dict(self) -> dict:
        return {"components": dict(self.components), "total_bytes": self.total_bytes, "note": self.note}


@dataclass
class MemoryEstimate:
    model: str
    params: int
    trainable_params: int
    gpu: str
    gpu_memory_bytes: int
    settings: MemorySettings
    phases: dict[str, Phase]
    kv_cache_bytes: int = 0  # per GPU, rollout engine
    kv_bytes_per_token: int = 0  # per GPU
    kv_cache_tokens: int = 0  # tokens the engine's KV cache holds (per engine replica)
    kv_cache_sequences: int = 0  # prompt+response sequences that fit in it at once
    host_phases: dict[str, Phase] = field(default_factory=dict)  # host memory of the busiest node (GPU runs)
    host_memory_bytes: int = 0  # host memory of one node available to the job; 0 = unknown, not checked
    assumptions: list[str] = field(default_factory=list)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name].total_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.phases[self.peak_phase].total_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_memory_bytes - self.peak_bytes

    @property
    def engine_starts(self) -> bool:
        """False when the engine's memory share leaves no room for a KV cache."""
        return not self.settings.is_rl or self.kv_cache_sequences >= 1

    @property
    def host_peak_phase(self) -> str | None:
        return max(self.host_phases, key=lambda name: self.host_phases[name].total_bytes) if self.host_phases else None

    @property
    def host_bytes(self) -> int:
        """Host memory the busiest node's processes use at their peak."""
        phase = self.host_peak_phase
        return self.host_phases[phase].total_bytes if phase else 0

    @property
    def host_limit_bytes(self) -> int:
        """Host memory a node may use: all of it but the margin kept for the system."""
        return int(self.host_memory_bytes * (1 - HOST_MARGIN_FRACTION))

    @property
    def host_fits(self) -> bool:
        return not self.host_memory_bytes or self.host_bytes <= self.host_limit_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0 and self.engine_starts and self.host_fits

    @property
    def verdict(self) -> str:
        peak, total = self.peak_bytes / GIB, self.gpu_memory_bytes / GIB
        problems = []
        if not self.engine_starts:
            problems.append(
                f"the rollout engine has no room for one {self.settings.seq_len}-token sequence of KV cache "
                f"(raise the memory fraction, the rollout TP, or offload the trainer)"
            )
        elif self.headroom_bytes < 0:
            problems.append(
                f"the {self.peak_phase} phase needs {peak:.1f} GiB per GPU, the {self.gpu} has {total:.1f} GiB"
            )
        if not self.host_fits:
            problems.append(
                f"host memory: the {self.host_peak_phase} phase needs {self.host_bytes / GIB:.1f} GiB per node, "
                f"a node has {self.host_memory_bytes / GIB:.0f} GiB ({self.host_limit_bytes / GIB:.1f} GiB usable "
                f"after the {HOST_MARGIN_FRACTION:.0%} kept for the system)"
            )
        if problems:
            return "does not fit: " + "; ".join(problems)
        share = self.headroom_bytes / self.gpu_memory_bytes
        tight = " (tight: allocator fragmentation may not fit)" if share < 0.05 else ""
        host = (
            f"; host {self.host_bytes / GIB:.0f} of {self.host_memory_bytes / GIB:.0f} GiB per node"
            if self.host_memory_bytes
            else ""
        )
        return f"fits: peak {peak:.1f} GiB ({self.peak_phase}) of {total:.1f} GiB, {share:.0%} headroom{tight}{host}"

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "params": self.params,
            "trainable_params": self.trainable_params,
            "gpu": self.gpu,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "settings": asdict(self.settings),
            "phases": {name: phase.to_dict() for name, phase in self.phases.items()},
            "peak_phase": self.peak_phase,
            "peak_bytes": self.peak_bytes,
            "headroom_bytes": self.headroom_bytes,
            "fits": self.fits,
            "verdict": self.verdict,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_tokens": self.kv_cache_tokens,
            "kv_cache_sequences": self.kv_cache_sequences,
            "host_phases": {name: phase.to_dict() for name, phase in self.host_phases.items()},
            "host_bytes": self.host_bytes,
            "host_memory_bytes": self.host_memory_bytes,
            "host_fits": self.host_fits,
            "assumptions": list(self.assumptions),
        }


@lru_cache(maxsize=64)
def count_params(spec: ModelSpec) -> int:
    """The catalog's exact count, memoised (the planner estimates many layouts of one model)."""
    return _count_params(spec)


# ---------------------------------------------------------------------------------------------
# Layout: which parameters and layers one GPU holds


def pipeline_split(num_layers: int, pp: int) -> list[int] | None:
    """Layers per pipeline stage, or None when ``pp`` cannot split ``num_layers``.

    Even stages when ``pp`` divides the layers; otherwise the other stages stay even and the last
    one holds fewer layers (Megatron's ``num_layers_in_last_pipeline_stage``), e.g. 61 layers in 16
    stages = 15 x 4 + 1. The last stage also computes the output head and the loss.
    """
    if pp < 1 or pp > num_layers:
        return None
    if num_layers % pp == 0:
        return [num_layers // pp] * pp
    for last in range(num_layers // pp, 0, -1):
        if (num_layers - last) % (pp - 1) == 0 and last <= (num_layers - last) // (pp - 1):
            return [(num_layers - last) // (pp - 1)] * (pp - 1) + [last]
    return None


@dataclass
class _Stage:
    """What one GPU holds: the busiest GPU of a pipeline stage (FSDP: every GPU)."""

    label: str
    layers: list[tuple[LayerParams, int]]  # (layer shape, how many)
    dense_params: int  # non-expert parameters of the stage, whole (before TP / sharding)
    expert_params: int  # routed experts of the stage, whole
    adapter_params: int  # LoRA adapters of the stage, whole
    has_head: bool  # computes the logits and the loss
    in_flight: int  # micro batches whose activations are alive at once (1F1B: pp - stage index)
    tensors: list[Tensor]  # its parameter tensors, whole (before TP / sharding)


def _ceil(x: float) -> int:
    return math.ceil(x)


def _stages(spec: ModelSpec, s: MemorySettings) -> list[_Stage]:
    """The stages worth evaluating: FSDP's one; for a pipeline the first, second and last."""
    rank, targets = s.lora_rank, s.lora_targets
    if s.backend == "fsdp":
        experts = expert_params(spec)
        return [
            _Stage(
                "every GPU",
                layer_kinds(spec),
                count_params(spec) - experts,
                experts,
                lora_params(spec, rank, targets),
                True,
                1,
                tensors(spec),
            )
        ]
    split = pipeline_split(spec.num_layers, s.pp)
    assert split is not None
    out = []
    for i in sorted({0, min(1, s.pp - 1), s.pp - 1}):
        start = sum(split[:i])
        kinds = layer_kinds(spec, start, start + split[i])
        dense = sum((layer.total - layer.experts) * n for layer, n in kinds)
        if i == 0:
            dense += embedding_params(spec)
        if i == s.pp - 1:  # final norm + output head (a tied head is a second copy once pp > 1)
            dense += spec.hidden_size + (lm_head_params(spec) if s.pp == 1 else spec.vocab_size * spec.hidden_size)
        label = f"pipeline stage {i} of {s.pp} ({split[i]} layers)" if s.pp > 1 else "every GPU"
        last = i == s.pp - 1
        parts = tensors(spec, start, start + split[i], embedding=i == 0, head=last)
        if last and s.pp > 1 and spec.tie_embeddings:
            parts.append(Tensor(spec.vocab_size, spec.hidden_size, 1, "tp"))  # the tied head's copy
        out.append(
            _Stage(
                label,
                kinds,
                dense,
                sum(layer.experts * n for layer, n in kinds),
                lora_params(spec, rank, targets, start, start + split[i]),
                last,
                s.pp - i,
                parts,
            )
        )
    return out


# ---------------------------------------------------------------------------------------------
# Terms


def model_states(spec: ModelSpec, s: MemorySettings, stage: _Stage) -> dict[str, int]:
    """Weights, gradients and AdamW states one GPU holds for the policy (or any trained model).

    FSDP2 full shard over N GPUs: fp32 master weights 4, fp32 gradients 4, Adam m+v 8 bytes per
    parameter, all divided by N (the compute-dtype copy of a layer exists only while gathered).
    Megatron with the distributed optimizer: compute-dtype weights and fp32 gradients on every
    data-parallel rank of a (tp, pp, ep) shard, fp32 master + m + v divided by the DP size.
    LoRA: the frozen base in the compute dtype, and the adapters' full states.
    """
    cb = s.compute_bytes
    master = 0 if cb == 4 else 4  # fp32 training keeps no separate master copy
    if s.backend == "fsdp":
        n = s.gpus
        if s.lora_rank:
            return {
                "weights": _ceil((cb * (stage.dense_params + stage.expert_params) + 4 * stage.adapter_params) / n),
                "gradients": _ceil(4 * stage.adapter_params / n),
                "optimizer_states": _ceil(ADAM_STATE_BYTES * stage.adapter_params / n),
            }
        params = stage.dense_params + stage.expert_params
        return {
            "weights": _ceil(4 * params / n),
            "gradients": _ceil(4 * params / n),
            "optimizer_states": _ceil(ADAM_STATE_BYTES * params / n),
        }
    dense = _ceil(stage.dense_params / s.tp)
    experts = _ceil(stage.expert_params / s.ep)
    edp = s.gpus // (s.pp * s.ep)  # expert data parallel (expert tensor parallel = 1)
    if s.lora_rank:
        adapters = _ceil(stage.adapter_params / s.tp)
        return {
            "weights": cb * (dense + experts + adapters),
            "gradients": 4 * adapters,
            "optimizer_states": _ceil((master + ADAM_STATE_BYTES) * adapters / s.dp),
        }
    return {
        "weights": cb * (dense + experts),
        "gradients": 4 * (dense + experts),
        "optimizer_states": _ceil((master + ADAM_STATE_BYTES) * dense / s.dp)
        + _ceil((master + ADAM_STATE_BYTES) * experts / edp),
    }


def fsdp_buffers(spec: ModelSpec, s: MemorySettings) -> int:
    """Unsharded FSDP2 buffers: the layer being computed and the prefetched next one, gathered
    in the compute dtype, plus the output head (the root unit stays gathered from the forward to
    the end of the backward); full fine-tuning adds their unsharded gradients before the
    reduce-scatter (one layer and the head)."""
    cb = s.compute_bytes
    layer, head = largest_layer_params(spec), spec.vocab_size * spec.hidden_size
    gathered = cb * (2 * layer + head)
    grads = 0 if s.lora_rank else cb * (layer + head)
    return gathered + grads


def layer_activation_values(spec: ModelSpec, layer: LayerParams) -> tuple[int, int]:
    """Values stored per token for one layer's backward: (outside TP regions, inside TP regions).

    Korthikanti et al. (2022) count ``34 s b h`` bytes per layer in bf16: 10 outside the tensor-
    parallel regions (two layernorm inputs 4, the attention and MLP inputs 2 + 2, two dropout masks
    2) and 24 inside (Q, K, V 6, attention output 2, the 4h MLP 16). For today's models: no dropout,
    FlashAttention (no ``5 a s / h`` score matrix), grouped-query K and V, a gated MLP of width f that
    keeps its gate, up, activation and product (4f values instead of 2 x 4h), MLA's latents, and
    for MoE the k routed copies of each token with their expert activations plus the router logits.
    """
    h = spec.hidden_size
    outside = (4 if spec.arch == "gemma2" else 2) * h + 2 * h  # norm inputs + attention/MLP inputs
    if spec.uses_mla:
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        outside += 2 * spec.q_lora_rank + 2 * spec.kv_lora_rank + spec.qk_rope_head_dim
        inside = spec.num_heads * (2 * qk + 2 * spec.v_head_dim)
    else:
        q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        inside = 2 * q + 2 * kv  # Q, K, V and the attention output
    inside += 4 * sum(lin.fan_out for lin in layer.mlp if lin.name.endswith("up_proj"))
    if layer.is_moe:
        f = spec.expert_intermediate_size
        outside += spec.experts_per_token * (h + 4 * f) + 2 * spec.num_experts  # routed tokens, fp32 router logits
    return outside, inside


def activation_bytes(spec: ModelSpec, s: MemorySettings, stage: _Stage) -> int:
    """Activations alive on one GPU for its micro batches in flight.

    Without checkpointing every layer keeps all its values; with full activation checkpointing a
    layer keeps only its input (``2 s b h`` in bf16) and one layer at a time is recomputed with its
    full activations. Tensor parallelism divides the inside values by t; sequence parallelism
    divides the outside ones too (and the kept inputs). Context parallelism divides the tokens.
    """
    tokens, cb = s.tokens_per_micro_batch, s.compute_bytes
    sp = s.tp if s.sequence_parallel else 1

    def full(layer: LayerParams) -> int:
        outside, inside = layer_activation_values(spec, layer)
        return cb * tokens * _ceil(outside / sp + inside / s.tp)

    if not s.activation_checkpointing:
        return stage.in_flight * sum(full(layer) * n for layer, n in stage.layers)
    kept = cb * tokens * _ceil(spec.hidden_size / sp) * sum(n for _, n in stage.layers)
    return stage.in_flight * kept + max(full(layer) for layer, _ in stage.layers)


def logits_bytes(spec: ModelSpec, s: MemorySettings) -> int:
    """``b s V`` logits of the micro batch: the compute-dtype output, an fp32 copy for the loss,
    and the fp32 log-softmax (reused for its gradient); vocabulary-parallel under TP."""
    return s.tokens_per_micro_batch * _ceil(spec.vocab_size / s.tp) * (s.compute_bytes + LOGIT_EXTRA_BYTES)


def critic_params(spec: ModelSpec) -> int:
    """A critic is the policy's body with a scalar value head instead of the output head."""
    return count_params(spec) - lm_head_params(spec) + spec.hidden_size + 1


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
    per_token = 2 * h + _ceil((qkv + 3 * f) / rollout_tp)
    return tokens * per_token * dtype_bytes + sequences * _ceil(spec.vocab_size / rollout_tp) * 4


# ---------------------------------------------------------------------------------------------
# Host memory


def pow2ceil(n: int) -> int:
    """The allocation torch's pinned-memory caching allocator makes for ``n`` bytes: the next power of two."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def _shard_numel(s: MemorySettings, t: Tensor) -> int:
    """Elements of one GPU's piece of tensor ``t``: FSDP2 shards dim 0 over every GPU (padding it to a
    multiple of N); Megatron splits it by TP (or EP) and its distributed optimizer over the data-parallel group."""
    if s.backend == "fsdp":
        return _ceil(t.rows / s.gpus) * t.cols
    if t.split == "ep":
        return _ceil(_ceil(t.rows / s.ep) * t.cols / (s.gpus // (s.pp * s.ep)))
    return _ceil((_ceil(t.rows / s.tp) if t.split == "tp" else t.rows) * t.cols / s.dp)


def pinned_bytes(s: MemorySettings, parts: list[Tensor], value_bytes: int) -> int:
    """Host bytes of one GPU's pieces of ``parts``, pinned: each rounded up to a power of two."""
    return sum(t.count * pow2ceil(_shard_numel(s, t) * value_bytes) for t in parts)


def host_memory_per_node(gpu: GpuSpec, s: MemorySettings) -> int:
    """The host memory one node gives the job: as set, else the GPU type's node shared by the GPUs used."""
    if s.host_memory_bytes:
        return s.host_memory_bytes
    return gpu.host_memory_bytes * s.gpus_per_node // gpu.gpus_per_node


def _host_offload(s: MemorySettings, stage: _Stage, states: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """One GPU's trainer states in host memory: (for the whole run, only during rollout).

    FSDP2 ``CPUOffloadPolicy(pin_memory=True)``: the sharded weights and gradients are pinned (in
    power-of-two blocks), the AdamW states pageable. Megatron ``optimizer_cpu_offload``: pinned fp32
    master weights and gradient copies, pageable AdamW states; ``offload_params`` (RL) moves the
    weights and the gradient buffer to the host while the engine generates.
    """
    cb = s.compute_bytes
    whole: dict[str, int] = {}
    rollout: dict[str, int] = {}
    if s.cpu_offload:
        if s.lora_rank:
            adapters = stage.adapter_params
            whole["offloaded_weights"] = pinned_bytes(s, stage.tensors, cb) + _ceil(4 * adapters / s.gpus)
            whole["offloaded_gradients"] = states["gradients"]
        else:
            whole["offloaded_weights"] = pinned_bytes(s, stage.tensors, 4)
            whole["offloaded_gradients"] = pinned_bytes(s, stage.tensors, 4)
        whole["offloaded_optimizer"] = states["optimizer_states"]
    elif s.megatron_optimizer_offload:
        if s.lora_rank:
            whole["offloaded_gradients"] = _ceil(4 * _ceil(stage.adapter_params / s.tp) / s.dp)
            whole["offloaded_optimizer"] = states["optimizer_states"]
        else:
            edp = s.gpus // (s.pp * s.ep)
            fp32 = pinned_bytes(s, stage.tensors, 4)  # the master weights, and the gradient copies
            adam = _ceil(ADAM_STATE_BYTES * _ceil(stage.dense_params / s.tp) / s.dp) + _ceil(
                ADAM_STATE_BYTES * _ceil(stage.expert_params / s.ep) / edp
            )
            whole["offloaded_gradients"] = fp32
            whole["offloaded_optimizer"] = fp32 + adam
    if s.backend == "megatron" and s.offload_params and s.is_rl:
        rollout["offloaded_weights"] = states["weights"] + (0 if s.lora_rank else states["gradients"])
    return whole, rollout


def _host_phases(
    spec: ModelSpec, s: MemorySettings, stages: list[_Stage], stage_states: list[dict[str, int]], critic_ratio: float
) -> dict[str, Phase]:
    """Host memory of the busiest node in each phase: what its ``gpus_per_node`` processes keep in CPU memory.

    - training: offloaded states (and the idle reference and critic when offloaded), a sleeping
      vLLM engine's weights (vLLM's sleep level 1 keeps them in CPU memory; SGLang releases them);
    - rollout (RL): offloaded states, plus Megatron's between-phase offload;
    - loading (FSDP): rank 0 reads the whole checkpoint into CPU memory and scatters it into the
      (offloaded) shards of the others;
    - every phase: ``HOST_PROCESS_BYTES`` per GPU process.
    """
    cb, k = s.compute_bytes, s.gpus_per_node
    phases: dict[str, list[dict[str, int]]] = {"training": [], "rollout": [], "loading": []}
    for stage, states in zip(stages, stage_states):
        whole, between = _host_offload(s, stage, states)
        reference = 0
        if s.is_rl and s.kl and not s.lora_rank and s.idle_weights_offloaded:
            reference = (
                pinned_bytes(s, stage.tensors, cb)
                if s.cpu_offload
                else cb * (_ceil(stage.dense_params / s.tp) + _ceil(stage.expert_params / s.ep))
            )
        critic = _ceil(critic_ratio * (sum(whole.values()) + sum(between.values()))) if s.has_critic else 0
        common = {**whole, "reference_model": reference, "critic": critic, "processes": HOST_PROCESS_BYTES}
        engine = 0
        if s.is_rl and s.rollout == "vllm":
            engine = _ceil(cb * count_params(spec) / s.rollout_tp)
        phases["training"].append({**common, "engine_weights": engine})
        phases["rollout"].append({**common, **{key: common.get(key, 0) + v for key, v in between.items()}})
        if s.backend == "fsdp":
            critic_weights = _ceil(critic_ratio * whole.get("offloaded_weights", 0)) if s.has_critic else 0
            phases["loading"].append(
                {
                    "checkpoint": 0,
                    "offloaded_weights": whole.get("offloaded_weights", 0),
                    "reference_model": reference,
                    "critic": critic_weights,
                    "processes": HOST_PROCESS_BYTES,
                }
            )
    out = {}
    for name, per_gpu in phases.items():
        if not per_gpu or (name == "rollout" and not s.is_rl):
            continue
        busiest = max(per_gpu, key=lambda parts: sum(parts.values()))
        node = {key: value * k for key, value in busiest.items()}
        if name == "loading":
            node["checkpoint"] = CHECKPOINT_BYTES * count_params(spec)  # rank 0's copy, once per job
        out[name] = Phase(node, f"{k} GPU process{'es' if k > 1 else ''} per node")
    return out


# ---------------------------------------------------------------------------------------------
# The estimate


def estimate_memory(model: ModelSpec, gpu: GpuSpec, s: MemorySettings) -> MemoryEstimate:
    """Per-GPU memory of each phase of the job on the busiest GPU, and the busiest node's host memory."""
    s.check(model)
    cb = s.compute_bytes
    cuda = s.device == "cuda"
    context = CUDA_CONTEXT_BYTES if cuda else 0
    stages = _stages(model, s)
    trainable = lora_params(model, s.lora_rank, s.lora_targets) if s.lora_rank else count_params(model)
    critic_ratio = critic_params(model) / count_params(model)

    weights_off, optimizer_off = s.idle_weights_offloaded, s.idle_optimizer_offloaded
    train_phases, rollout_phases, stage_states = [], [], []
    for stage in stages:
        states = model_states(model, s, stage)
        stage_states.append(states)
        train = {k: 0 for k in states} if s.cpu_offload else dict(states)
        if s.megatron_optimizer_offload:
            train["optimizer_states"] = 0  # on the CPU for the whole run; the CPU steps it
        if s.backend == "fsdp":
            train["unsharded_buffers"] = fsdp_buffers(model, s)
        train["activations"] = activation_bytes(model, s, stage)
        train["logits"] = logits_bytes(model, s) if stage.has_head else 0
        reference = 0
        if s.is_rl and s.kl and not s.lora_rank and not weights_off:  # LoRA: the base with adapters off
            whole = stage.dense_params + stage.expert_params
            reference = (
                _ceil(cb * whole / s.gpus)
                if s.backend == "fsdp"
                else cb * (_ceil(stage.dense_params / s.tp) + _ceil(stage.expert_params / s.ep))
            )
        idle_critic = 0
        if s.has_critic:  # idle while the actor updates: weights and optimizer unless offloaded
            idle_critic = _ceil(
                critic_ratio
                * ((0 if weights_off else states["weights"]) + (0 if optimizer_off else states["optimizer_states"]))
            )
        train["reference_model"] = reference
        train["critic"] = idle_critic
        train["cuda_context"] = context
        train_phases.append(Phase(train, stage.label))

        if s.is_rl:
            resident = {
                "trainer_weights": 0 if weights_off else states["weights"],
                # FSDP frees gradients after the step; Megatron keeps its contiguous gradient buffer
                "trainer_gradients": 0 if weights_off or s.backend == "fsdp" else states["gradients"],
                "trainer_optimizer": 0 if optimizer_off else states["optimizer_states"],
                "reference_model": reference,
                "critic": idle_critic,
            }
            rollout_phases.append((resident, stage.label))

    phases = {"training": max(train_phases, key=lambda p: p.total_bytes)}
    est = MemoryEstimate(
        model=model.name,
        params=count_params(model),
        trainable_params=trainable,
        gpu=gpu.name,
        gpu_memory_bytes=gpu.memory_bytes,
        settings=s,
        phases=phases,
    )
    if s.is_rl:
        engine = _engine(model, gpu, s, est)
        rollout = []
        for resident, label in rollout_phases:
            rollout.append(Phase({**engine, **resident, "cuda_context": context}, label))
        phases["rollout"] = max(rollout, key=lambda p: p.total_bytes)
    if cuda:
        est.host_phases = _host_phases(model, s, stages, stage_states, critic_ratio)
        est.host_memory_bytes = host_memory_per_node(gpu, s)
    est.assumptions = _assumptions(model, gpu, s, est)
    return est


def _engine(model: ModelSpec, gpu: GpuSpec, s: MemorySettings, est: MemoryEstimate) -> dict[str, int]:
    """The rollout engine's share of one GPU; fills the estimate's KV-cache fields."""
    rtp = s.rollout_tp
    eb = s.compute_bytes  # engines run in the compute dtype (bf16 on GPUs)
    weights = _ceil(eb * count_params(model) / rtp)
    per_token = kv_bytes_per_token(model, rtp, eb)
    replicas = s.gpus // rtp
    batch_sequences = _ceil(s.rollout_batch * s.rollout_n / replicas)
    seq = s.prompt_len + s.response_len
    if s.rollout == "hf" or s.device == "cpu":
        # no preallocation: the cache grows to the batch it generates, prefill is the transient peak
        kv = batch_sequences * seq * per_token
        act = engine_activation_bytes(model, batch_sequences * s.prompt_len, batch_sequences, rtp, eb)
        parts = {"engine_weights": weights, "kv_cache": kv, "engine_activations": act}
    else:
        budget = int(s.mem_fraction * gpu.memory_bytes)
        act = engine_activation_bytes(model, ENGINE_BATCHED_TOKENS, ENGINE_MAX_SEQS, rtp, eb)
        if s.rollout == "vllm":  # gpu_memory_utilization covers weights, activations and the cache
            kv = budget - weights - act
        else:  # sglang's mem_fraction_static covers weights and the KV pool; activations come on top
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


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def _assumptions(model: ModelSpec, gpu: GpuSpec, s: MemorySettings, est: MemoryEstimate) -> list[str]:
    """The choices behind the numbers, in words, so they can be checked and changed."""
    cb = s.compute_bytes
    out = []
    if s.is_rl:
        out.append(
            f"sequence length {s.seq_len} tokens (prompt {s.prompt_len} + response {s.response_len}), "
            f"micro batch {s.micro_batch}: {s.tokens_per_micro_batch} tokens per forward"
        )
    else:
        out.append(
            f"sequence length {s.seq_len} tokens, micro batch {s.micro_batch}: "
            f"{s.tokens_per_micro_batch} tokens per forward (packed)"
        )
    what = (
        f"LoRA rank {s.lora_rank} on {s.lora_targets} ({est.trainable_params:,} adapter parameters), frozen base in {s.dtype}"
        if s.lora_rank
        else "full fine-tuning"
    )
    if s.backend == "fsdp":
        states = "fp32 master weights, fp32 gradients and AdamW m, v" if not s.lora_rank else "the adapters' states"
        out.append(f"{what}; FSDP2 full shard over {s.gpus} GPUs: {states} divided by {s.gpus}")
        out.append(
            f"FSDP gathers two decoder layers ({largest_layer_params(model):,} parameters each) and keeps the "
            f"output head gathered through the backward, in {s.dtype}"
        )
    else:
        out.append(
            f"{what}; Megatron tp {s.tp} x pp {s.pp} x dp {s.dp}"
            + (f", ep {s.ep}" if s.ep > 1 else "")
            + f": {s.dtype} weights and fp32 gradients per shard, fp32 master and AdamW m, v divided by dp "
            "(distributed optimizer)"
        )
        if s.pp > 1:
            out.append(
                f"pipeline 1F1B: stage i keeps pp - i micro batches of activations; the busiest stage is reported "
                f"({est.phases['training'].note})"
            )
    if model.is_moe:
        out.append(
            f"MoE: all {model.num_experts} experts count for weights and optimizer states; activations follow the "
            f"{model.experts_per_token} routed experts a token uses (balanced routing assumed)"
        )
    if s.cpu_offload:
        out.append(
            "FSDP2 CPU offload: sharded weights, gradients and AdamW states live on the CPU (weights and gradients "
            "pinned), the optimizer steps there; only the gathered layers and activations use the GPU"
        )
    if s.megatron_optimizer_offload:
        out.append(
            "Megatron optimizer CPU offload (megatron-core optimizer_cpu_offload, fraction 1.0, precision-aware "
            "optimizer): fp32 master weights, gradient copies and AdamW states on the CPU, the optimizer steps "
            "there; the GPU keeps the bf16 weights and the fp32 gradient buffer"
        )
    if s.backend == "megatron" and s.offload_params and s.is_rl:
        out.append(
            "Megatron weight offload between phases: the weights and the gradient buffer wait on the CPU while the "
            "engine generates and return for the update"
        )
    ckpt = "on: each layer keeps its input, one layer at a time is recomputed" if s.activation_checkpointing else "off"
    out.append(f"activation checkpointing {ckpt}; attention by FlashAttention/SDPA kernels (no s x s scores stored)")
    out.append(
        f"logits: {s.dtype} output + fp32 copy + fp32 log-softmax ({cb + LOGIT_EXTRA_BYTES} bytes per token per "
        f"vocabulary entry)"
    )
    if s.is_rl:
        if s.kl and s.lora_rank:
            out.append("reference model: the base with the adapters disabled (no second copy)")
        elif s.kl:
            out.append(
                f"reference model: {s.dtype} weights sharded like the policy"
                + (", on the CPU" if s.idle_weights_offloaded else "")
            )
        if s.has_critic:
            out.append(
                "critic: the policy's body with a value head, trained after the actor (its own activations are "
                "smaller: no vocabulary logits); idle, it keeps its weights and optimizer states unless offloaded"
            )
        out.append(
            "the rollout engine sleeps while the trainer updates (weights to CPU, KV cache freed, as verl's colocated engines)"
        )
        kept = [
            name
            for name, off in (("weights", s.idle_weights_offloaded), ("optimizer states", s.idle_optimizer_offloaded))
            if not off
        ]
        freed = "gradients freed" if s.backend == "fsdp" else "gradient buffer kept unless params are offloaded"
        out.append(f"during rollout the trainer keeps its {' and '.join(kept) or 'nothing'} on the GPU ({freed})")
        if s.rollout == "hf" or s.device == "cpu":
            out.append(
                f"{s.rollout} engine: KV cache sized for its share of the batch ({s.rollout_batch} prompts x {s.rollout_n})"
            )
        else:
            frac = f"{s.mem_fraction:.2f} x {_gib(gpu.memory_bytes)}"
            cover = (
                "weights, activations and KV cache"
                if s.rollout == "vllm"
                else "weights and KV pool (activations on top)"
            )
            out.append(
                f"{s.rollout} (tp {s.rollout_tp}): memory fraction {frac} covers its {cover}; "
                f"CUDA graphs {_gib(ENGINE_GRAPH_BYTES)} on top; {ENGINE_BATCHED_TOKENS} tokens per engine step"
            )
    if s.device == "cuda":
        out.append(f"CUDA context, cuBLAS workspaces and NCCL buffers: {_gib(CUDA_CONTEXT_BYTES)} per GPU")
        k = s.gpus_per_node
        if s.host_memory_bytes:
            where = "as given"
        elif gpu.host_memory_bytes:
            where = f"a {gpu.name} node's {_gib(gpu.host_memory_bytes)}" + (
                f" shared by {gpu.gpus_per_node} GPUs, {k} used" if k != gpu.gpus_per_node else ""
            )
        else:
            where = "unknown for this GPU type: not checked"
        out.append(
            f"host memory per node: {_gib(est.host_memory_bytes)} ({where}); {HOST_MARGIN_FRACTION:.0%} kept for the "
            f"system; {_gib(HOST_PROCESS_BYTES)} per GPU process; pinned offloaded tensors rounded up to powers of two "
            "(torch's caching host allocator)"
        )
        if s.backend == "fsdp":
            out.append(
                f"loading: FSDP's rank 0 reads the whole checkpoint into host memory ({CHECKPOINT_BYTES} bytes per "
                "parameter) and scatters it to the other ranks"
            )
        if s.is_rl and s.rollout == "vllm":
            out.append("vLLM sleeps at level 1 while the trainer updates: its weights wait in host memory")
    return out
