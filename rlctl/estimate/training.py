"""The training phase: which parameters and layers one GPU holds, its model states, the unsharded
FSDP buffers, activations, logits, and the critic. Formulas and sources: docs/estimate.md."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from rlctl.catalog import count_params as _count_params
from rlctl.catalog import layer_params as largest_layer_params
from rlctl.catalog import pipeline_split
from rlctl.catalog.count import embedding_params, lm_head_params, vision_params
from rlctl.catalog.parallel import sp_kv_heads
from rlctl.catalog.spec import ModelSpec, VisionSpec
from rlctl.estimate.inventory import (
    LayerParams,
    Tensor,
    expert_params,
    layer_kinds,
    lora_params,
    tensors,
)
from rlctl.estimate.settings import (
    ADAM_STATE_BYTES,
    CHUNK_LOGIT_BYTES,
    LOGIT_EXTRA_BYTES,
    VOCAB_PARALLEL_CHUNK_VALUES,
    VOCAB_PARALLEL_CHUNKS,
    MemorySettings,
)


@lru_cache(maxsize=64)
def count_params(spec: ModelSpec) -> int:
    """The catalog's exact count, memoised (the planner estimates many layouts of one model)."""
    return _count_params(spec)


@dataclass
class Stage:
    """What one GPU holds: the busiest GPU of a pipeline stage (FSDP: every GPU)."""

    label: str
    layers: list[tuple[LayerParams, int]]  # (layer shape, how many)
    dense_params: int  # non-expert parameters of the stage, whole (before TP / sharding)
    expert_params: int  # routed experts of the stage, whole
    adapter_params: int  # LoRA adapters of the stage, whole
    has_head: bool  # computes the logits and the loss
    in_flight: int  # micro batches whose activations are alive at once (1F1B: pp - stage index)
    tensors: list[Tensor]  # its parameter tensors, whole (before TP / sharding)
    vision_params: int = 0  # a VL model's vision tower (part of dense_params), whole


def job_stages(spec: ModelSpec, s: MemorySettings) -> list[Stage]:
    """The stages worth evaluating: FSDP's one; for a pipeline the first, second and last."""
    rank, targets = s.lora_rank, s.lora_targets
    if s.backend == "fsdp":
        experts = expert_params(spec)
        return [
            Stage(
                "every GPU",
                layer_kinds(spec),
                count_params(spec) - experts,
                experts,
                lora_params(spec, rank, targets, vision=s.train_vision),
                True,
                1,
                tensors(spec),
                vision_params(spec),
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
            Stage(
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


def model_states(spec: ModelSpec, s: MemorySettings, stage: Stage) -> dict[str, int]:
    """Weights, gradients and AdamW states one GPU holds for the policy (or any trained model).

    FSDP2 full shard over N GPUs: fp32 master weights 4, fp32 gradients 4, Adam m+v 8 bytes per
    parameter, all divided by N (the compute-dtype copy of a layer exists only while gathered).
    Megatron with the distributed optimizer: compute-dtype weights and fp32 gradients on every
    data-parallel rank of a (tp, pp, ep) shard, fp32 master + m + v divided by the DP size.
    LoRA: the frozen base in the compute dtype, and the adapters' full states. A VL model's vision
    tower is frozen unless ``train_vision`` (LoRA: then it gets adapters too, rlctl.engines.vision).
    """
    cb = s.compute_bytes
    master = 0 if cb == 4 else 4  # fp32 training keeps no separate master copy
    if s.backend == "fsdp":
        n = s.fsdp_shards
        # trained tensors: fp32 (mixed precision) or bf16 (pure bf16: weights, gradients, AdamW m and v)
        tb = 2 if s.pure_bf16 else 4
        adam = ADAM_STATE_BYTES * tb // 4
        params = stage.dense_params + stage.expert_params
        if s.lora_rank:  # the frozen base (a VL model's tower too) in the compute dtype, the adapters trained
            trained, weights = stage.adapter_params, cb * params + tb * stage.adapter_params
        else:  # FSDP keeps every parameter in the trained dtype, a frozen vision tower's too (no grads, no AdamW)
            trained, weights = params - (0 if s.train_vision else stage.vision_params), tb * params
        return {
            "weights": math.ceil(weights / n),
            "gradients": math.ceil(tb * trained / n),
            "optimizer_states": math.ceil(adam * trained / n),
        }
    dense = math.ceil(stage.dense_params / s.tp)
    experts = math.ceil(stage.expert_params / s.ep)
    edp = s.gpus // (s.pp * s.ep)  # expert data parallel (expert tensor parallel = 1)
    if s.lora_rank:
        adapters = math.ceil(stage.adapter_params / s.tp)
        return {
            "weights": cb * (dense + experts + adapters),
            "gradients": 4 * adapters,
            "optimizer_states": math.ceil((master + ADAM_STATE_BYTES) * adapters / s.dp),
        }
    return {
        "weights": cb * (dense + experts),
        "gradients": 4 * (dense + experts),
        "optimizer_states": math.ceil((master + ADAM_STATE_BYTES) * dense / s.dp)
        + math.ceil((master + ADAM_STATE_BYTES) * experts / edp),
    }


def fsdp_buffers(spec: ModelSpec, s: MemorySettings) -> int:
    """Unsharded FSDP2 buffers: the layer being computed and the prefetched next one, gathered
    in the compute dtype, plus the output head (the root unit stays gathered from the forward to
    the end of the backward); full fine-tuning adds their unsharded gradients before the
    reduce-scatter (one layer and the head). A VL model's vision tower is one unit of its own."""
    if not s.sharded:
        return 0  # a plain module on one GPU: nothing is gathered, gradients land in place
    cb = s.compute_bytes
    layer, head = largest_layer_params(spec), spec.vocab_size * spec.hidden_size
    # a VL model's vision tower is one FSDP unit (rlctl.engines.vision): gathered whole, the first layer prefetched
    tower = vision_params(spec)
    gathered = cb * (max(2 * layer, tower + layer) + head)
    grads = 0 if s.lora_rank else cb * (max(layer, tower if s.train_vision else 0) + head)
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


def activation_bytes(spec: ModelSpec, s: MemorySettings, stage: Stage) -> int:
    """Activations alive on one GPU for its micro batches in flight.

    Without checkpointing every layer keeps all its values; with full activation checkpointing a
    layer keeps only its input (``2 s b h`` in bf16) and one layer at a time is recomputed with its
    full activations. Tensor parallelism divides the inside values by t; sequence parallelism
    divides the outside ones too (and the kept inputs). Context parallelism and Ulysses sequence
    parallelism divide the tokens (:attr:`MemorySettings.tokens_per_micro_batch`): under Ulysses each
    GPU keeps every value of its ``1 / sp`` of the sequence, the attention's Q, K, V and output as
    ``heads / sp`` over the whole sequence, the same count; what Ulysses adds is :func:`ulysses_bytes`.
    """
    tokens, cb = s.tokens_per_micro_batch, s.compute_bytes
    sp = s.tp if s.sequence_parallel else 1  # Megatron's sequence parallelism shards the outside values

    def full(layer: LayerParams) -> int:
        outside, inside = layer_activation_values(spec, layer)
        return cb * tokens * math.ceil(outside / sp + inside / s.tp)

    def mlp(layer: LayerParams) -> int:  # the gated MLP's inside values: recomputed by selective checkpointing
        return cb * tokens * math.ceil(4 * sum(lin.fan_out for lin in layer.mlp if lin.name.endswith("up_proj")) / s.tp)

    largest = max(full(layer) for layer, _ in stage.layers)
    if s.activation_checkpointing:
        per_layer = [(cb * tokens * math.ceil(spec.hidden_size / sp), n) for _, n in stage.layers]
    elif s.selective_checkpointing:
        per_layer = [(full(layer) - mlp(layer), n) for layer, n in stage.layers]
    else:
        per_layer = [(full(layer), n) for layer, n in stage.layers]
    if s.offload_activations:  # saved tensors live in host memory: the layer in flight and the one copying
        return (2 if s.activation_checkpointing else 1) * max(kept for kept, _ in per_layer) + largest
    kept = stage.in_flight * sum(kept * n for kept, n in per_layer)
    if s.activation_checkpointing:
        return kept + largest  # one layer recomputed with all its values during its backward
    if s.selective_checkpointing:
        return kept + max(mlp(layer) for layer, _ in stage.layers)
    return kept


def attention_saved_layers(s: MemorySettings, stage: Stage) -> int:
    """Layers whose attention tensors are alive at once: every layer in flight without checkpointing or
    with selective checkpointing (attention kept); one (the layer recomputed, or in flight while the
    others wait on the host) with full checkpointing or activation offload."""
    if s.activation_checkpointing or s.offload_activations:
        return 1
    return stage.in_flight * sum(n for _, n in stage.layers)


def ulysses_bytes(spec: ModelSpec, s: MemorySettings, stage: Stage) -> int:
    """What Ulysses sequence parallelism adds on one GPU beyond ``1 / sp`` of the activations, as
    rlctl.engines.ulysses runs it.

    Per layer, the Q, K and V of the local ``T / sp`` tokens (all heads) are traded by all-to-all for
    ``heads / sp`` over all ``T`` tokens, attention runs, and its output is traded back:
    - in flight, the layer being computed: its Q, K, V in the sequence layout wait beside their traded
      copies until attention runs, ``(q + 2 kv) T / sp`` values (with the KV heads repeated up to
      ``sp``, the repeated K and V too), and one trade's contiguous send and receive buffers, the
      largest Q's, ``2 q T / sp``;
    - saved, for each layer whose attention tensors are alive: the output in both layouts (attention
      keeps the head-sharded one, the output projection its sequence-sharded input; one tensor
      without SP), ``q T / sp``, and the repeated K and V beyond the model's ``2 kv T / sp``.
    ``q`` = heads x head_dim, ``kv`` = KV heads x head_dim, in the compute dtype. 0 without SP.
    """
    if s.sp == 1:
        return 0
    tokens, cb = s.tokens_per_micro_batch, s.compute_bytes
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    kv_sent = sp_kv_heads(s.sp, spec.num_kv_heads) * spec.head_dim
    repeated = 2 * kv_sent if kv_sent > kv else 0
    in_flight = q + 2 * kv + repeated + 2 * q
    saved = q + 2 * (kv_sent - kv)
    return cb * tokens * (in_flight + attention_saved_layers(s, stage) * saved)


def vision_block_values(v: VisionSpec) -> int:
    """Values one vision block stores per patch for its backward: two norm inputs, the attention and MLP
    inputs, q/k/v and the attention output, and the MLP's (Qwen2.5-VL: gate, up, activation and product;
    Qwen2-VL: fc1's output and its activation)."""
    w, f = v.hidden_size, v.intermediate_size
    return 4 * w + 4 * w + (4 if v.arch == "qwen2_5_vl" else 2) * f


def vision_activation_bytes(spec: ModelSpec, s: MemorySettings) -> int:
    """The vision tower's activations for the images of one micro batch.

    Frozen (the default), no gradient reaches it: nothing is kept, and its forward's transient is one
    block's values over the patches (counted, although the decoder's peak comes later). Trained, it keeps
    what the decoder keeps: each block's input under activation checkpointing (one block recomputed at a
    time), else every block's values.
    """
    v = spec.vision
    if v is None or not s.image_patches:
        return 0
    samples = max(1, s.tokens_per_micro_batch // s.seq_len)
    patches, cb = samples * s.image_patches, s.compute_bytes
    block = cb * patches * vision_block_values(v)
    if not s.train_vision:
        return block
    if s.activation_checkpointing:
        return v.depth * cb * patches * v.hidden_size + block
    return v.depth * block


def divergence_bytes(beta: float) -> int:
    """``algo.distill=full``: fp32 bytes per logit that the divergence saves for its backward (rlctl.algos.distill.
    generalized_jsd), counted with saved-tensor hooks: the reverse KL (beta 1) the student's log-softmax, softmax
    and log-ratio; the forward KL (0) the log-softmax and the teacher's softmax; a JSD between them six tensors."""
    return {1.0: 12, 0.0: 8}.get(beta, 24)


def logit_tokens(s: MemorySettings) -> int:
    """Positions whose logits the loss needs on one GPU. SFT, and RL on Megatron (its output layer runs on
    every position of its unpacked rows): every token of the GPU's share. RL on FSDP (or with a chunked
    loss): the response positions only; every RL micro batch carries ``logit_index`` or ``keep_cols``, which
    FSDPEngine.forward_micro passes as ``logits_to_keep`` (measured on the first GPU run: docs/gpu.md G2).
    Under Ulysses SP each GPU computes the logits of the kept positions of its ``1 / sp`` of the sequence
    (rlctl.engines.ulysses.ShardedLogits) and only ``[N]`` floats are gathered; the GPU that holds the
    sequence's end holds the most response positions (its whole shard when the response is longer than a
    shard) and sets the peak. SFT and DPO on FSDP: the labelled positions only (``keep_cols``,
    rlctl.data.packing.labelled_columns), ``labelled_share`` of the micro batch's; under SP the GPU whose
    shard holds the most of them, at worst all (a prompt-first sequence's answer in the last shard)."""
    tokens = s.tokens_per_micro_batch
    if s.is_rl and (s.backend == "fsdp" or s.loss_chunk):
        rows = tokens * s.cp * s.sp / s.seq_len
        return min(tokens, math.ceil(rows * s.response_len))
    if s.keeps_labelled:
        return max(1, min(tokens, math.ceil(tokens * s.sp * s.labelled_share)))
    return tokens


def logits_bytes(spec: ModelSpec, s: MemorySettings) -> int:
    """Logits alive at the loss's peak. Unfused (the peak is in the loss's backward): ``b s V`` logits
    in the compute dtype, the fp32 log-softmax saved for the backward, its fp32 gradient and the
    logits' gradient in the compute dtype (12 bytes per value in bf16). Chunked (``loss_chunk`` tokens at a time, the
    chunk's backward before the next chunk): one chunk's logits, fp32 upcast, log-softmax and
    gradient. Vocabulary-parallel under Megatron's TP: ``V / tp`` per GPU, as the engine computes them (its loss
    reads only its rank's columns, never gathered, in row chunks: rlctl.algos.vocab_parallel): the logits and their
    gradient in the compute dtype, and :func:`vocab_parallel_chunks_bytes`."""
    vocab = math.ceil(spec.vocab_size / s.tp)
    teacher = teacher_logits_bytes(spec, s)
    if s.loss_chunk:
        return min(s.loss_chunk, logit_tokens(s)) * vocab * (s.compute_bytes + CHUNK_LOGIT_BYTES) + teacher
    if s.vocab_parallel:
        values = logit_tokens(s) * vocab
        return values * 2 * s.compute_bytes + vocab_parallel_chunks_bytes(values) + teacher
    return logit_tokens(s) * vocab * (2 * s.compute_bytes + LOGIT_EXTRA_BYTES) + teacher


def vocab_parallel_chunks_bytes(values: int) -> int:
    """The vocab-parallel loss's fp32 temporaries beside the logits: a few row chunks of at most
    ``VOCAB_PARALLEL_CHUNK_VALUES`` values each (fewer values than that: all of them), whatever the micro batch
    (measured on CPU, 8192 x 16384 bf16 logits: 1.5 chunks for the log-probs and entropy, 3.5 for the JSD)."""
    return min(values, VOCAB_PARALLEL_CHUNK_VALUES) * 4 * VOCAB_PARALLEL_CHUNKS


def teacher_logits_bytes(spec: ModelSpec, s: MemorySettings) -> int:
    """``algo.distill=full``: the teacher's logits (compute dtype, no gradient; not chunked by ``loss_chunk``),
    its fp32 log-softmax, and the student's fp32 tensors saved for the divergence's backward (:func:`divergence_bytes`:
    12 bytes per value for the reverse KL) beside the compute dtype. Per GPU: under Ulysses sp the positions of its
    sequence shard (:func:`logit_tokens`), under Megatron's TP its ``1 / tp`` of the vocabulary (the teacher's
    logits are never gathered), the compute dtype only: the vocab-parallel divergence keeps the teacher's logits for
    its backward and its fp32 values in row chunks (:func:`vocab_parallel_chunks_bytes`, counted with the
    student's). Without pipeline stages the teacher is forwarded per micro batch inside the loss: one micro batch's
    logits (on Megatron at every position: its output layer runs on all). With pipeline stages (Megatron ``pp``
    above 1) the teacher's pipeline runs before each update pass and the last stage keeps the teacher's logits at
    the response positions of every micro batch of the pass: :func:`staged_teacher_tokens` positions, in the compute
    dtype; the divergence's fp32 tensors stay one micro batch's. 0 otherwise."""
    if not (s.teacher_logits and s.teacher_params and s.is_rl):
        return 0
    vocab = math.ceil(spec.vocab_size / s.tp)
    extra = 0 if s.vocab_parallel else divergence_bytes(s.distill_beta)
    if s.backend == "megatron" and s.pp > 1:
        return staged_teacher_tokens(s) * vocab * s.compute_bytes + logit_tokens(s) * vocab * extra
    return logit_tokens(s) * vocab * (s.compute_bytes + extra)


def staged_teacher_tokens(s: MemorySettings) -> int:
    """Response positions of one update pass (a mini-batch: ``mini_batch_prompts``, else the whole step) on one
    data-parallel rank, every response at ``response_len``: the teacher's logits a last pipeline stage keeps."""
    prompts = min(s.mini_batch_prompts or s.rollout_batch, s.rollout_batch)
    return math.ceil(prompts * s.rollout_n / s.dp) * s.response_len


def critic_params(spec: ModelSpec) -> int:
    """A critic is the policy's body with a scalar value head instead of the output head."""
    return count_params(spec) - lm_head_params(spec) + spec.hidden_size + 1
