"""One plan: resolve the inputs, choose the backend tier, search the options, relax, give reasons.

This is the planner without its "what would fit" advice, so that `--what-to-rent`
(:mod:`rlctl.plan.rent`) and the advice (:mod:`rlctl.plan.fit`) can call it: the dependency runs one
way, core <- rent <- fit <- planner.
"""

from __future__ import annotations

from rlctl.catalog import active_params
from rlctl.config import RunConfig
from rlctl.errors import UserError
from rlctl.plan import rules
from rlctl.plan.inputs import Job, backend_the_engine_runs, resolve_job
from rlctl.plan.local import OPTIONAL_PACKAGES, LocalEnv
from rlctl.plan.reasons import rejected_reason, rollout_reasons
from rlctl.plan.search import SearchResult, margin_ok, options_for, relax, search
from rlctl.plan.types import Plan


def plan_config(cfg: RunConfig, local: LocalEnv, *, host_memory_bytes: int = 0) -> Plan:
    """The plan of ``cfg`` on ``local``, without the "what would fit" advice of an unfit plan
    (:func:`rlctl.plan.planner.resolve_plan` adds it): what `--what-to-rent` runs at each count."""
    return plan_with_search(cfg, local, host_memory_bytes=host_memory_bytes)[0]


def plan_with_search(cfg: RunConfig, local: LocalEnv, *, host_memory_bytes: int = 0) -> tuple[Plan, Job, SearchResult]:
    """:func:`plan_config`, with the resolved inputs and the search's result behind the plan."""
    job = resolve_job(cfg, local, host_memory_bytes)
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
    tier = backend_the_engine_runs(job, tier, reasons)
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
    if job.is_rl:
        rules.check_rollout_engine_tp(job.engine, cfg.rollout.tp)

    options = options_for(job, tier)
    if len(options) > 1:
        reasons.append(
            "options, in order of preference: "
            + "; ".join(o.label for o in options)
            + " (the first that fits with the margin wins)"
        )
    result = search(job, options)
    est, backend = result.est, result.option.backend
    s = est.settings
    reasons += [rejected_reason(r) for r in result.rejected if r.option != result.option]
    if backend != tier:
        how = "is the first option that fits" if est.fits else "comes closest (no option fits)"
        reasons.append(f"backend {backend}: {result.option.label} {how}")
    if cfg.parallel.sequence_parallel is True and backend == "fsdp":
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
    if backend == "fsdp" and not s.sharded:
        one = "one GPU" if job.device == "cuda" else "one process"
        reasons.append(f"parallel: {one}, the plain module (no FSDP): every state on it")
    elif backend == "fsdp":
        reasons.append(
            f"parallel: FSDP2 full shard, dp {s.dp}: weights, gradients and optimizer states split over "
            f"{job.world} ranks"
        )
    else:
        ep = f" x ep {s.ep}" if s.ep > 1 else ""
        reasons.append(
            f"parallel: tp {s.tp} x pp {s.pp} x dp {s.dp}{ep}: the most data-parallel layout whose update fits"
            + (", sequence parallel on" if s.sequence_parallel else "")
        )
    user_offload = None not in (p.offload_params, p.offload_optimizer)
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
        est = relax(job, est, reasons)
        s = est.settings
    if job.is_rl:
        rollout_reasons(job, est, result.kv_short, reasons, warnings)
    reasons.extend(job.later)
    if est.fits and not margin_ok(est):
        warnings.append(
            f"less than {rules.tiers()['memory']['margin_fraction']:.0%} of GPU memory to spare: "
            "an allocator's fragmentation may not fit; more GPUs or offload give room"
        )
    reasons.append(f"estimate: {est.verdict}")
    plan = Plan(
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
        selective_checkpointing=s.selective_checkpointing,
        offload_activations=s.offload_activations,
        shard=s.shard,
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
    return plan, job, result
