"""Host memory: what a node's processes keep in CPU memory (offloaded states, a sleeping engine,
loading the checkpoint, the processes themselves)."""

from __future__ import annotations

import math

from rlctl.catalog.spec import GpuSpec, ModelSpec
from rlctl.estimate.inventory import Tensor
from rlctl.estimate.result import Phase
from rlctl.estimate.settings import ADAM_STATE_BYTES, CHECKPOINT_BYTES, HOST_PROCESS_BYTES, MemorySettings
from rlctl.estimate.training import Stage, count_params


def pow2ceil(n: int) -> int:
    """The allocation torch's pinned-memory caching allocator makes for ``n`` bytes: the next power of two."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def shard_numel(s: MemorySettings, t: Tensor) -> int:
    """Elements of one GPU's piece of tensor ``t``: FSDP2 shards dim 0 over every GPU (padding it to a
    multiple of N); Megatron splits it by TP (or EP) and its distributed optimizer over the data-parallel group."""
    if s.backend == "fsdp":
        return math.ceil(t.rows / s.fsdp_shards) * t.cols
    if t.split == "ep":
        return math.ceil(math.ceil(t.rows / s.ep) * t.cols / (s.gpus // (s.pp * s.ep)))
    return math.ceil((math.ceil(t.rows / s.tp) if t.split == "tp" else t.rows) * t.cols / s.dp)


def pinned_bytes(s: MemorySettings, parts: list[Tensor], value_bytes: int) -> int:
    """Host bytes of one GPU's pieces of ``parts``, pinned: each rounded up to a power of two."""
    return sum(t.count * pow2ceil(shard_numel(s, t) * value_bytes) for t in parts)


def host_memory_per_node(gpu: GpuSpec, s: MemorySettings) -> int:
    """The host memory one node gives the job: as set, else the GPU type's node shared by the GPUs used."""
    if s.host_memory_bytes:
        return s.host_memory_bytes
    return gpu.host_memory_bytes * s.gpus_per_node // gpu.gpus_per_node


def host_offload(s: MemorySettings, stage: Stage, states: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
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
            whole["offloaded_weights"] = pinned_bytes(s, stage.tensors, cb) + math.ceil(4 * adapters / s.fsdp_shards)
            whole["offloaded_gradients"] = states["gradients"]
        else:
            whole["offloaded_weights"] = pinned_bytes(s, stage.tensors, 4)
            whole["offloaded_gradients"] = pinned_bytes(s, stage.tensors, 4)
        whole["offloaded_optimizer"] = states["optimizer_states"]
    elif s.megatron_optimizer_offload:
        if s.lora_rank:
            whole["offloaded_gradients"] = math.ceil(4 * math.ceil(stage.adapter_params / s.tp) / s.dp)
            whole["offloaded_optimizer"] = states["optimizer_states"]
        else:
            edp = s.gpus // (s.pp * s.ep)
            fp32 = pinned_bytes(s, stage.tensors, 4)  # the master weights, and the gradient copies
            adam = math.ceil(ADAM_STATE_BYTES * math.ceil(stage.dense_params / s.tp) / s.dp) + math.ceil(
                ADAM_STATE_BYTES * math.ceil(stage.expert_params / s.ep) / edp
            )
            whole["offloaded_gradients"] = fp32
            whole["offloaded_optimizer"] = fp32 + adam
    if s.backend == "megatron" and s.offload_params and s.is_rl:
        rollout["offloaded_weights"] = states["weights"] + (0 if s.lora_rank else states["gradients"])
    return whole, rollout


def host_phases(
    spec: ModelSpec, s: MemorySettings, stages: list[Stage], stage_states: list[dict[str, int]], critic_ratio: float
) -> dict[str, Phase]:
    """Host memory of the busiest node in each phase: what its ``gpus_per_node`` processes keep in CPU memory.

    - training: offloaded states (and the idle reference and critic when offloaded); a sleeping engine
      keeps nothing here (vLLM sleeps at level 2 and SGLang without a CPU backup: both discard the weights);
    - rollout (RL): offloaded states, plus Megatron's between-phase offload;
    - loading (FSDP): rank 0 reads the whole checkpoint into CPU memory and scatters it into the
      (offloaded) shards of the others;
    - every phase: ``HOST_PROCESS_BYTES`` per GPU process.
    """
    cb, k = s.compute_bytes, s.gpus_per_node
    phases: dict[str, list[dict[str, int]]] = {"training": [], "rollout": [], "loading": []}
    for stage, states in zip(stages, stage_states):
        whole, between = host_offload(s, stage, states)
        reference = 0
        if s.keeps_reference and s.idle_weights_offloaded:
            reference = (
                pinned_bytes(s, stage.tensors, cb)
                if s.cpu_offload
                else cb * (math.ceil(stage.dense_params / s.tp) + math.ceil(stage.expert_params / s.ep))
            )
        critic = math.ceil(critic_ratio * (sum(whole.values()) + sum(between.values()))) if s.has_critic else 0
        teacher = s.teacher_bytes if s.idle_weights_offloaded else 0
        common = {
            **whole,
            "reference_model": reference,
            "teacher_model": teacher,
            "critic": critic,
            "processes": HOST_PROCESS_BYTES,
        }
        phases["training"].append(dict(common))
        phases["rollout"].append({**common, **{key: common.get(key, 0) + v for key, v in between.items()}})
        if s.backend == "fsdp":
            critic_weights = math.ceil(critic_ratio * whole.get("offloaded_weights", 0)) if s.has_critic else 0
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
        out[name] = Phase(node, f"{k} GPU process{'es' if k > 1 else ''} per node", slack=0.0)
    return out
