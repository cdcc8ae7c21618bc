"""Host memory: what a node's processes keep in CPU memory (offloaded states, a sleeping engine,
loading and saving the checkpoint, the processes themselves)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def tp_numel(s: MemorySettings, t: Tensor) -> int:
    """Elements of one Megatron rank's piece of tensor ``t`` before the distributed optimizer: its TP (or EP) split."""
    div = s.tp if t.split == "tp" else s.ep if t.split == "ep" else 1
    return math.ceil(t.rows / div) * t.cols


@dataclass(frozen=True)
class SaveBytes:
    """Host bytes one Megatron rank adds while it saves a checkpoint (``MegatronEngine.save_checkpoint``)."""

    held: int  # the gathered fp32 master weights, exp_avg and exp_avg_sq of its tp/pp shard, through the save
    gather: int  # beside them while they are gathered: the rank's own shards and one bucket's all-gather
    write: int  # beside them while a data-parallel rank 0 writes: the optimizer tensors' clones and the weights

    @property
    def gather_peak(self) -> int:
        return self.held + self.gather

    @property
    def write_peak(self) -> int:
        """On a data-parallel rank 0; the other ranks write nothing and hold ``held``."""
        return self.held + self.write


def megatron_save_bytes(s: MemorySettings, stage: Stage) -> SaveBytes:
    """What megatron-core 0.16.1 puts in host memory when rlctl saves (``fully_reshardable``, not mem-efficient).

    ``get_parameter_state_dp_zero(use_gloo_comm=False, return_on_all_ranks=True)`` all-gathers the distributed
    optimizer's fp32 param, exp_avg and exp_avg_sq over the data-parallel group into CPU tensors of the whole
    gradient buffer on every rank: 12 bytes per parameter of the rank's tp/pp shard (``held``, kept by the state
    dict until the save returns). Per bucket (one per buffer: ``overlap_grad_reduce=False``) it also holds the
    rank's own three shards (12 / dp bytes per element) and, per state, the gathered pieces copied to the CPU,
    their concatenation and the previous state's concatenation (12 bytes). Then the torch_dist writer of each
    data-parallel rank 0 (the main replica) clones every optimizer tensor (views of the gathered buffers: 12
    bytes) and copies the weights off the GPU (non-blocking, so pinned: each tensor rounded up to a power of
    two). Measured on CPU: tests/estimate/test_checkpoint_save.py.
    """
    cb = s.compute_bytes
    edp = s.gpus // (s.pp * s.ep)  # expert data parallel (expert tensor parallel 1)
    if s.lora_rank:  # only the adapters have optimizer states (one buffer)
        dense, experts = math.ceil(stage.adapter_params / s.tp), 0
    else:
        dense, experts = math.ceil(stage.dense_params / s.tp), math.ceil(stage.expert_params / s.ep)
    held = 12 * (dense + experts)
    gather = 12 * (dense + math.ceil(dense / s.dp))
    if experts:  # the expert buffer comes second, while the dense one's last concatenation is still alive
        gather = max(gather, 4 * dense + 12 * (experts + math.ceil(experts / edp)))
    if s.device == "cuda":
        weights = sum(t.count * pow2ceil(tp_numel(s, t) * cb) for t in stage.tensors)
    else:  # on CPU the weights are views into DDP's buffer, cloned
        weights = cb * sum(t.count * tp_numel(s, t) for t in stage.tensors)
    weights += cb * math.ceil(stage.adapter_params / s.tp)
    return SaveBytes(held, gather, held + weights)


def checkpoint_save_parts(s: MemorySettings, stage: Stage) -> dict[str, int]:
    """The busiest node's extra host memory while the Megatron engine saves: every rank gathers at once, then the
    node's data-parallel rank-0 ranks write (ranks are numbered tp first, then dp, so node 0 has the most)."""
    k = s.gpus_per_node
    one = megatron_save_bytes(s, stage)
    writers = sum(1 for r in range(k) if (r // (s.tp * s.cp)) % s.dp == 0)
    if k * one.gather >= writers * one.write:
        return {"save_optimizer_copy": k * one.held, "save_gather_buffers": k * one.gather}
    return {"save_optimizer_copy": k * one.held, "save_write_copies": writers * one.write}


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
    - save (Megatron): the training phase's host memory plus the checkpoint save's (:func:`checkpoint_save_parts`);
    - every phase: ``HOST_PROCESS_BYTES`` per GPU process.
    """
    k = s.gpus_per_node
    phases: dict[str, list[dict[str, int]]] = {"training": [], "rollout": [], "loading": [], "save": []}
    for stage, states in zip(stages, stage_states):
        common, between = _resident(s, stage, states, critic_ratio)
        phases["training"].append(_times(common, k))
        phases["rollout"].append(_times({**common, **{key: common.get(key, 0) + v for key, v in between.items()}}, k))
        if s.backend == "fsdp":
            critic_weights = math.ceil(critic_ratio * common.get("offloaded_weights", 0)) if s.has_critic else 0
            loading = {
                "checkpoint": 0,
                "offloaded_weights": common.get("offloaded_weights", 0),
                "reference_model": common["reference_model"],
                "critic": critic_weights,
                "processes": HOST_PROCESS_BYTES,
            }
            phases["loading"].append(_times(loading, k))
        else:
            phases["save"].append({**_times(common, k), **checkpoint_save_parts(s, stage)})
    out = {}
    for name, per_node in phases.items():
        if not per_node or (name == "rollout" and not s.is_rl):
            continue
        node = max(per_node, key=lambda parts: sum(parts.values()))
        if name == "loading":
            node["checkpoint"] = CHECKPOINT_BYTES * count_params(spec)  # rank 0's copy, once per job
        out[name] = Phase(node, f"{k} GPU process{'es' if k > 1 else ''} per node", slack=0.0)
    return out


def _times(parts: dict[str, int], k: int) -> dict[str, int]:
    return {key: value * k for key, value in parts.items()}


def _resident(
    s: MemorySettings, stage: Stage, states: dict[str, int], critic_ratio: float
) -> tuple[dict[str, int], dict[str, int]]:
    """One GPU's host memory in every phase (offloaded states, idle models, the process), and what
    Megatron's between-phase offload adds during rollout."""
    whole, between = host_offload(s, stage, states)
    reference = 0
    if s.keeps_reference and s.idle_weights_offloaded:
        reference = (
            pinned_bytes(s, stage.tensors, s.compute_bytes)
            if s.cpu_offload
            else s.compute_bytes * (math.ceil(stage.dense_params / s.tp) + math.ceil(stage.expert_params / s.ep))
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
    return common, between
