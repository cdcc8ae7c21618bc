"""The assumptions behind an estimate, in words, so they can be checked and changed."""

from __future__ import annotations

from rlctl.catalog import layer_params as largest_layer_params
from rlctl.catalog.count import vision_params
from rlctl.catalog.gpus import vllm_batch_limits
from rlctl.catalog.parallel import sp_kv_heads
from rlctl.catalog.spec import GpuSpec, ModelSpec
from rlctl.estimate.result import MemoryEstimate
from rlctl.estimate.settings import (
    ALLOCATOR_SLACK,
    CHECKPOINT_BYTES,
    CHUNK_LOGIT_BYTES,
    CUDA_CONTEXT_BYTES,
    ENGINE_BATCHED_TOKENS,
    ENGINE_GRAPH_BYTES,
    ENGINE_MAX_SEQS,
    GIB,
    HOST_MARGIN_FRACTION,
    HOST_PROCESS_BYTES,
    LOGIT_EXTRA_BYTES,
    MemorySettings,
)
from rlctl.estimate.training import divergence_bytes, staged_teacher_tokens, vocab_parallel_chunks_bytes


def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def assumptions(model: ModelSpec, gpu: GpuSpec, s: MemorySettings, est: MemoryEstimate) -> list[str]:
    """The choices behind the numbers, in words, so they can be checked and changed."""
    out = _batch(model, s) + _layout(model, s, est) + _vision(model, s) + _memory_options(s)
    if s.is_rl:
        out += _rl_models_and_engine(gpu, s)
    out += _preference(s)
    if s.device == "cuda":
        out += _device_and_host(gpu, s, est)
    return out


def _preference(s: MemorySettings) -> list[str]:
    """dpo's reference and rm's head, in words."""
    if s.method == "rm":
        return ["reward model: the body and a scalar head are trained (no output head, no logits)"]
    if s.method != "dpo":
        return []
    if s.lora_rank:
        return ["reference: the base with its LoRA adapters off (no second copy)"]
    if s.keeps_reference:
        return ["reference: a frozen copy beside the policy in the compute dtype, sharded (per-step log-probs)"]
    return [
        "reference: log-probs precomputed once by a frozen copy freed before the policy is built (8 bytes per "
        "pair kept; no reference counted in training)"
    ]


def _batch(model: ModelSpec, s: MemorySettings) -> list[str]:
    """The tokens of one forward."""
    out = []
    images = f" + {s.image_tokens} image tokens" if s.image_tokens else ""
    if s.is_rl:
        out.append(
            f"sequence length {s.seq_len} tokens (prompt {s.prompt_len}{images} + response {s.response_len}), "
            f"micro batch {s.micro_batch}: {s.tokens_per_micro_batch} tokens per forward{_per_gpu(s)}"
        )
    else:
        text = f" ({s.max_len} text{images})" if images else ""
        unit = f" pairs of {s.seqs_per_unit} sequences" if s.seqs_per_unit > 1 else ""
        out.append(
            f"sequence length {s.seq_len} tokens{text}, micro batch {s.micro_batch}{unit}: "
            f"{s.tokens_per_micro_batch} tokens per forward (packed){_per_gpu(s)}"
        )
    if s.sp > 1:
        out.append(_ulysses(model, s))
    return out


def _per_gpu(s: MemorySettings) -> str:
    return f" per GPU (each sequence split over sp {s.sp} GPUs)" if s.sp > 1 else ""


def _ulysses(model: ModelSpec, s: MemorySettings) -> str:
    """What Ulysses sequence parallelism divides, and what it adds."""
    kv = sp_kv_heads(s.sp, model.num_kv_heads)
    repeated = f" ({model.num_kv_heads} KV heads repeated to {kv})" if kv > model.num_kv_heads else ""
    return (
        f"Ulysses sequence parallelism sp {s.sp} (dp {s.dp} x sp {s.sp}): each GPU keeps the activations of 1/{s.sp} "
        "of the sequence and computes the logits and per-token losses of its share (only those floats are "
        "gathered); attention trades sequence shards for head shards by all-to-all "
        f"({model.num_heads // s.sp} query heads per GPU over the whole sequence{repeated}); the all-to-all line "
        "counts a layer's Q, K, V in both layouts, one trade's send and receive buffers, and the attention output "
        "kept in both layouts"
    )


def _vision(model: ModelSpec, s: MemorySettings) -> list[str]:
    """A VL model's vision tower: its parameters, whether it trains, and what an image costs."""
    v = model.vision
    if v is None:
        return []
    family = "Qwen2.5-VL" if v.arch == "qwen2_5_vl" else "Qwen2-VL"
    tower = (
        f"vision tower ({family} ViT: {v.depth} blocks of width {v.hidden_size}, patch {v.patch_size}, "
        f"merge {v.spatial_merge_size}x{v.spatial_merge_size}): {vision_params(model):,} parameters"
    )
    if s.train_vision and s.lora_rank:
        tower += ", trained (--train-vision): LoRA adapters on its linear layers too"
    elif s.train_vision:
        tower += ", trained (--train-vision): full states like the text model"
    else:
        tower += (
            ", frozen: its weights sharded with the model's, no gradients or AdamW states (--train-vision "
            "trains it); its forward keeps no activations (one block's transient is counted)"
        )
    tower += "; it is one FSDP unit, gathered whole for its forward"
    pixels = s.image_pixels or v.max_pixels
    where = "" if s.image_pixels else " (the processor's max_pixels)"
    per_image = v.patches(pixels)
    images = (
        f"images: {s.images} per sample at up to {pixels:,} pixels{where}: {per_image} patches of "
        f"{v.patch_size}x{v.patch_size} each through the vision tower, merged into {v.image_tokens(pixels)} tokens "
        "added to the sequence (training and the rollout engine's prefill and KV cache)"
    )
    return [tower, images]


def _layout(model: ModelSpec, s: MemorySettings, est: MemoryEstimate) -> list[str]:
    """What is trained, and how its states are split over the GPUs."""
    out = []
    what = (
        f"LoRA rank {s.lora_rank} on {s.lora_targets} ({est.trainable_params:,} adapter parameters), "
        f"frozen base in {s.dtype}"
        if s.lora_rank
        else "full fine-tuning"
    )
    if s.backend == "fsdp":
        kind = "bf16 (pure bf16)" if s.pure_bf16 else "fp32"
        states = f"{kind} master weights, gradients and AdamW m, v" if not s.lora_rank else "the adapters' states"
        if s.sharded:
            n = s.fsdp_shards
            out.append(f"{what}; FSDP2 full shard over {n} GPUs: {states} divided by {n}")
            out.append(
                f"FSDP gathers two decoder layers ({largest_layer_params(model):,} parameters each) and keeps the "
                f"output head gathered through the backward, in {s.dtype}"
            )
        else:
            one = "one GPU" if s.device == "cuda" else "one process"
            out.append(f"{what}; {one}, the plain module (no FSDP wrappers, nothing gathered): {states}")
        if s.pure_bf16:
            out.append(
                "pure bf16: no fp32 master copy; AdamW updates below bf16's resolution (~1/256 of a weight) are "
                "rounded away, so long runs at small learning rates can drift from mixed precision"
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
    return out


def _memory_options(s: MemorySettings) -> list[str]:
    """Offload, checkpointing, micro batches and the loss: what each memory option changes."""
    out = []
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
    if not s.activation_checkpointing and s.selective_checkpointing:
        ckpt = "selective: each layer's MLP is recomputed (its input kept), attention keeps its tensors"
    out.append(f"activation checkpointing {ckpt}; attention by FlashAttention/SDPA kernels (no s x s scores stored)")
    if s.offload_activations:
        out.append(
            "activation offload: tensors saved for the backward wait in pinned host memory; the GPU keeps the layer "
            "being computed and the one being copied"
        )
    if s.micro_batch_tokens:
        out.append(f"micro batches packed to a budget of {s.micro_batch_tokens} tokens per GPU")
    out += _logit_lines(s)
    out.append(
        f"allocated = the tensors alive at the peak; reserved = allocated + {ALLOCATOR_SLACK:.0%} of the activations, "
        "logits and gathered layers (the caching allocator's slack); the fits verdict uses reserved + the CUDA "
        "context + the engine's pools, against the GPU less the planner's margin"
    )
    return out


def _logit_lines(s: MemorySettings) -> list[str]:
    """The LM head's logits and the loss on them: which positions, which columns, in chunks or whole."""
    cb = s.compute_bytes
    out = []
    if s.keeps_labelled:
        measured = (
            "measured on the data's first rows"
            if s.labelled_fraction is not None
            else "the default: no data measured; `rlctl estimate memory` measures a local model's data"
        )
        out.append(
            f"LM head and log-softmax at the labelled positions only: {s.labelled_share:.0%} of each micro batch's "
            f"({measured}); the prompts' positions, bar each one's last, and padding run no head"
        )
    if s.vocab_parallel:
        out.append(
            f"logits vocabulary-parallel: this GPU's 1/{s.tp} of the vocabulary, never gathered for the loss "
            "(log-probs, entropy, cross-entropy and the teacher's divergence all-reduce each row's max and sums "
            "over TP)"
        )
    if s.loss_chunk:
        where = (
            "response positions only"
            if s.is_rl
            else "labelled positions only"
            if s.keeps_labelled
            else "every position"
        )
        out.append(
            f"loss in chunks of {s.loss_chunk} tokens ({where}): one chunk's logits, fp32 upcast, log-softmax and "
            f"gradient alive at a time ({cb + CHUNK_LOGIT_BYTES} bytes per token per vocabulary entry)"
        )
    elif s.vocab_parallel:
        out.append(
            f"logits: {s.dtype} output and its gradient ({2 * cb} bytes per token per vocabulary entry) + the loss's "
            f"fp32 values in row chunks (at most {_gib(vocab_parallel_chunks_bytes(2**62))}), one loss per micro batch"
        )
    else:
        out.append(
            f"logits: {s.dtype} output and its gradient + fp32 log-softmax and its gradient "
            f"({2 * cb + LOGIT_EXTRA_BYTES} bytes per token per vocabulary entry), one unfused loss per micro batch"
        )
    return out


def _rl_models_and_engine(gpu: GpuSpec, s: MemorySettings) -> list[str]:
    """RL: the reference, reward and critic models, and the rollout engine beside the trainer."""
    out = []
    if not s.kl:
        out.append("no KL term: no reference model")
    if s.reward_model:
        out.append(
            f"reward model: frozen, assumed the policy's size; a whole replica on every GPU in "
            f"{s.reward_model_dtype} (reward.model_dtype), during rollout and update"
        )
    if s.kl and s.lora_rank:
        out.append("reference model: the base with the adapters disabled (no second copy)")
    elif s.kl:
        out.append(
            f"reference model: {s.dtype} weights sharded like the policy"
            + (", on the CPU" if s.idle_weights_offloaded else "")
        )
    if s.teacher_params:
        out.append(
            f"teacher model (distillation): {s.teacher_params / 1e9:.2f}B frozen parameters in {s.dtype}, sharded like "
            f"the policy" + (", on the CPU while idle" if s.idle_weights_offloaded else "")
        )
        if s.teacher_logits:
            split = f", this GPU's 1/{s.tp} of the vocabulary" if s.tp > 1 else ""
            split += f", its 1/{s.sp} of the sequence" if s.sp > 1 else ""
            held = "one micro batch's response positions"
            if s.backend == "megatron" and s.pp > 1:  # the teacher's pipeline runs before the update pass
                held = f"the {staged_teacher_tokens(s)} response positions of an update pass (every micro batch's)"
            fp32 = (
                "the divergence's fp32 values in row chunks"
                if s.vocab_parallel
                else f"{divergence_bytes(s.distill_beta)} bytes more per value for the fp32 tensors of the divergence"
            )
            what = f"the teacher's logits at {held} (compute dtype, {fp32}{split})"
            out.append(f"algo.distill=full: {what}, counted with the logits")
    if s.has_critic:
        out.append(
            "critic: the policy's body with a value head, trained after the actor (its own activations are "
            "smaller: no vocabulary logits); idle, it keeps its weights and optimizer states unless offloaded"
        )
    if s.rollout_procs:
        out.append(
            f"rollout split: {s.rollout_procs} rollout-only devices hold the engine (inference weights, KV cache, "
            f"activations) and nothing of the trainer; the {s.gpus} trainer-only devices hold the training states "
            "and no engine (docs/offpolicy.md)"
        )
    else:
        _colocated(s, out)
    if s.rollout == "hf" or s.device == "cpu":
        out.append(
            f"{s.rollout} engine: KV cache sized for its share of the batch ({s.rollout_batch} prompts x {s.rollout_n})"
        )
    else:
        frac = f"{s.mem_fraction:.2f} x {_gib(gpu.memory_bytes)}"
        cover = (
            "weights, activations and KV cache" if s.rollout == "vllm" else "weights and KV pool (activations on top)"
        )
        tokens, seqs = (
            vllm_batch_limits(gpu.memory_bytes, gpu.name)
            if s.rollout == "vllm"
            else (ENGINE_BATCHED_TOKENS, ENGINE_MAX_SEQS)
        )
        out.append(
            f"{s.rollout} (tp {s.rollout_tp}): memory fraction {frac} covers its {cover}; "
            f"CUDA graphs {_gib(ENGINE_GRAPH_BYTES)} on top; {tokens} tokens and {seqs} sequences per engine step"
        )
    return out


def _device_and_host(gpu: GpuSpec, s: MemorySettings, est: MemoryEstimate) -> list[str]:
    """The CUDA context, the host memory of a node, and loading the checkpoint."""
    out = []
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
    if s.backend == "megatron":
        out.append(
            "checkpoint save (Megatron, measured on CPU): every rank gathers the distributed optimizer's fp32 master "
            "weights, exp_avg and exp_avg_sq of its whole tp/pp shard into host memory (12 bytes per parameter, kept "
            "until the save returns; megatron-core's fully_reshardable format, not mem-efficient), with 12 + 12/dp "
            "bytes more while it gathers; each data-parallel rank 0 then writes clones of them and a pinned copy of "
            "its weights; the save phase is the training phase's host memory plus this"
        )
    if s.backend == "fsdp":
        out.append(
            f"loading: FSDP's rank 0 reads the whole checkpoint into host memory ({CHECKPOINT_BYTES} bytes per "
            "parameter) and scatters it to the other ranks"
        )
    return out


def _colocated(s: MemorySettings, out: list[str]) -> None:
    """The rollout engine and the trainer take turns on the same GPUs."""
    out.append(
        "the rollout engine sleeps while the trainer updates (weights and KV cache freed: vLLM's sleep "
        "level 2, SGLang's released memory; the next sync reloads the weights)"
    )
    kept = [
        name
        for name, off in (("weights", s.idle_weights_offloaded), ("optimizer states", s.idle_optimizer_offloaded))
        if not off
    ]
    freed = "gradients freed" if s.backend == "fsdp" else "gradient buffer kept unless params are offloaded"
    out.append(f"during rollout the trainer keeps its {' and '.join(kept) or 'nothing'} on the GPU ({freed})")
