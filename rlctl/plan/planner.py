"""The planner: a configuration and a :class:`~rlctl.plan.inputs.LocalEnv` in, one :class:`Plan` out,
every open (None) choice made and recorded as a :class:`~rlctl.plan.types.Decision`. It reads top to bottom:
resolve the inputs (rlctl.plan.inputs), choose the backend, search the options (rlctl.plan.search), relax
(rlctl.plan.relax), explain (rlctl.plan.decisions).

The planner is a pure function of the configuration (model, GPU type and count, nodes, method,
LoRA, overrides) and of the local machine. The local machine only matters where docs/presets.md
says so: the device and GPU type when they are not given, the CPU engine, and warnings about
packages missing here. A GPU plan printed on a laptop is the plan the cluster runs.

The search: for each option in order of preference (the backend tier without offload, FSDP2
without offload for a Megatron-tier model, then Megatron with its optimizer on the CPU, FSDP2
offloading every sharded state), each parallel layout in order of preference, each rollout TP size
from the smallest: the first combination whose estimate fits (GPU memory with the safety margin,
the nodes' host memory) and whose KV cache holds an engine's share of the batch wins; every option
before it is reported with its closest attempt. Checkpointing and the micro batch are then relaxed
while the update still fits comfortably. What would fit and `--what-to-rent` (rlctl.plan.advice) run
this same planner at other sizes; :func:`apply_plan` fills a config from a plan.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from rlctl.catalog import active_params
from rlctl.config import RunConfig, agent_enabled
from rlctl.errors import UserError
from rlctl.estimate.memory import MemoryEstimate
from rlctl.plan import rules
from rlctl.plan.decisions import (
    backend_warnings,
    eval_fraction_decision,
    explain_search,
    layout_decision,
    offload_decisions,
    rollout_decisions,
    sp_decision,
    split_decision,
)
from rlctl.plan.inputs import Job, LocalEnv, resolve_job
from rlctl.plan.relax import relax
from rlctl.plan.run_async import planned_decision
from rlctl.plan.search import SearchResult, eval_fraction, margin_ok, options_for, search
from rlctl.plan.types import Decision, Plan, Verdict
from rlctl.support import SP_RULES, megatron_gap, problems, refuse


def plan_config(cfg: RunConfig, local: LocalEnv, *, host_memory_bytes: int = 0) -> Plan:
    """The plan of ``cfg`` on ``local``, without the "what would fit" advice of an unfit plan
    (:func:`rlctl.plan.resolve_plan` adds it): what `--what-to-rent` runs at each count."""
    return plan_with_search(cfg, local, host_memory_bytes=host_memory_bytes)[0]


def plan_with_search(cfg: RunConfig, local: LocalEnv, *, host_memory_bytes: int = 0) -> tuple[Plan, Job, SearchResult]:
    """:func:`plan_config`, with the resolved inputs and the search's result behind the plan."""
    job = resolve_job(cfg, local, host_memory_bytes)
    decisions, warnings = job.decisions, job.warnings
    tier = choose_backend(job, decisions)
    options = options_for(job, tier)
    if len(options) > 1:
        labels = [o.label for o in options]
        why = f"options, in order of preference: {'; '.join(labels)} (the first that fits with the margin wins)"
        decisions.append(Decision("options", labels, why))
    result = search(job, options)
    est = result.est
    decisions += explain_search(tier, result)
    warnings += backend_warnings(job, result.option.backend, local)
    decisions.append(layout_decision(job, est.settings))
    sp = sp_decision(job, est)
    if sp is not None:
        decisions.append(sp)
    if est.fits:
        decisions += offload_decisions(job, est.settings)
        est = relax(job, est, decisions)
    if job.is_rl:
        rollout_decisions(job, est, result.kv_short, decisions, warnings)
    eval_frac = eval_fraction(job, est)
    if est.settings.rollout_procs:
        decisions.append(split_decision(job, est.settings))
        if job.cfg.method == "grpo":
            r = job.cfg.rollout
            decisions.append(planned_decision(r.mode, r.max_staleness, multi_turn=agent_enabled(job.cfg)))
        decisions += eval_fraction_decision(job, est.settings, eval_frac)
    decisions += job.later
    if est.fits and not margin_ok(est):
        warnings.append(
            f"less than {rules.tiers()['memory']['margin_fraction']:.0%} of GPU memory to spare: "
            "an allocator's fragmentation may not fit; more GPUs or offload give room"
        )
    return _plan(job, est, decisions, warnings, eval_frac), job, result


# ---------------------------------------------------------------------------------------------
# 1. Choose the backend


def choose_backend(job: Job, decisions: list[Decision]) -> str:
    """The backend tier (configured, or by the model's size), after what the Megatron engine runs; the
    parallel sizes the config sets are checked against it."""
    cfg, p = job.cfg, job.cfg.parallel
    if p.backend is None:
        decision = rules.choose_backend(
            job.spec,
            job.params,
            active_params(job.spec),
            device=job.device,
            world=job.world,
            gpu=job.gpu.name,
            lora=cfg.lora.rank > 0,
        )
        decisions.append(decision)
        tier = decision.value
    else:
        tier = p.backend
        if tier == "megatron" and job.device == "cpu":
            raise UserError("parallel.backend=megatron needs CUDA GPUs; on CPU use fsdp")
    tier = backend_the_engine_runs(job, tier, decisions)
    if p.backend is None and problems(replace(job.facts, backend=tier), "sp_backend"):
        why = f"backend fsdp: parallel.sp={p.sp} is the FSDP engine's Ulysses sequence parallelism"
        decisions.append(Decision("parallel.backend", "fsdp", why))
        tier = "fsdp"
    facts = replace(job.facts, backend=tier)
    refuse(facts, "fsdp_layout")
    rules.check_overrides(
        job.spec,
        tp=p.tp,
        pp=p.pp,
        ep=p.ep,
        cp=p.cp,
        world=job.world,
        rollout_tp=cfg.rollout.tp,
        is_rl=job.is_rl,
    )
    refuse(facts, *SP_RULES)
    refuse(facts, "critic_vision", "agent_vision", "split_vision")
    if job.is_rl:
        rules.check_rollout_engine_tp(job.engine, cfg.rollout.tp)
    return tier


def backend_the_engine_runs(job: Job, tier: str, decisions: list[Decision]) -> str:
    """The backend, after what rlctl's Megatron engine cannot run yet: a PPO critic and LoRA go to FSDP2
    (with offload when needed, as the search decides); a Megatron backend or Megatron-only sizes set
    in the config are a UserError there."""
    missing = megatron_gap(job.facts)
    if tier != "megatron" or missing is None:
        return tier
    refuse(job.facts, "megatron_forced")  # Megatron or its sizes configured
    decisions.append(
        Decision("parallel.backend", "fsdp", f"backend fsdp: the Megatron engine does not run {missing} yet: FSDP2")
    )
    return "fsdp"


def _plan(job: Job, est: MemoryEstimate, decisions: list[Decision], warnings: list[str], eval_frac: float) -> Plan:
    cfg, s, rl = job.cfg, est.settings, job.is_rl
    return Plan(
        method=cfg.method,
        model=job.spec.name if job.spec.source == "catalog" else cfg.model.name,
        params=job.params,
        device=job.device,
        gpu=job.gpu.name,
        gpus=job.world if job.device == "cuda" else 0,
        nodes=job.nodes,
        nproc_per_node=job.nproc,
        backend=s.backend,
        tp=s.tp,
        pp=s.pp,
        dp=s.dp,
        cp=s.cp,
        ep=s.ep,
        sp=s.sp,
        sequence_parallel=s.sequence_parallel,
        rollout=job.engine,
        rollout_tp=s.rollout_tp if rl else 0,
        rollout_mem_fraction=s.mem_fraction if rl and job.engine != "hf" and job.device == "cuda" else 0.0,
        rollout_eval_mem_fraction=eval_frac,
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
        decisions=decisions,
        warnings=warnings,
        verdict=Verdict.of(est),
        advice=[],
        estimate=est,
        fits=est.fits,
    )


# ---------------------------------------------------------------------------------------------
# The plan into the config


def apply_plan(cfg: RunConfig, plan: Plan) -> RunConfig:
    """A copy of ``cfg`` with every field the plan decides (None or 0) filled in, and the settings whose
    default depends on others written out (:func:`write_derived`): the resolved config has no None left
    in parallel.*, and the run's config.yaml says what ran."""
    out = copy.deepcopy(cfg)
    m, hw, par, tr, ro = out.model, out.hardware, out.parallel, out.train, out.rollout
    if m.dtype is None:
        m.dtype = plan.dtype
    # model.attn stays None: the engine picks flash_attention_2 where flash-attn is installed on
    # the GPU host and sdpa otherwise, at run time (plan.attn says what a GPU cluster will get).
    if hw.device is None:
        hw.device = plan.device
    if plan.device == "cuda":
        hw.gpus = hw.gpus or plan.gpus
        hw.gpu = hw.gpu or plan.gpu
    hw.nproc = hw.nproc or plan.nproc_per_node
    hw.nodes = plan.nodes or hw.nodes  # derived from the GPU type's node size when --nodes was not given
    if par.backend is None:
        par.backend = plan.backend
    par.tp, par.pp, par.ep = par.tp or plan.tp, par.pp or plan.pp, par.ep or plan.ep
    par.sp = par.sp or plan.sp
    for key, value in (
        ("sequence_parallel", plan.sequence_parallel),
        ("activation_checkpointing", plan.activation_checkpointing),
        ("offload_params", plan.offload_params),
        ("offload_optimizer", plan.offload_optimizer),
        ("selective_checkpointing", plan.selective_checkpointing),
        ("offload_activations", plan.offload_activations),
        ("shard", plan.shard),
    ):
        if getattr(par, key) is None:
            setattr(par, key, value)
    tr.micro_batch_size = tr.micro_batch_size or plan.micro_batch_size
    if plan.rollout is not None:
        if ro.engine is None:
            ro.engine = plan.rollout
        ro.tp = ro.tp or plan.rollout_tp
        ro.mem_fraction = ro.mem_fraction or plan.rollout_mem_fraction
        ro.eval_mem_fraction = ro.eval_mem_fraction or plan.rollout_eval_mem_fraction
    write_derived(out)
    return out


DEFAULT_MAX_TURNS = 8  # agent.max_turns of a run with tools, an environment or an interaction


def write_derived(cfg: RunConfig) -> None:
    """The settings whose default depends on other settings, written once into the resolved ``cfg``
    (its readers take them from there): ``agent.max_turns`` of an agent run (8 when not given), and an RL
    run's ``algo.mini_batch_size`` (0, the whole batch: ``train.batch_size``; never more than it). The
    recipes still cap the mini-batch by the prompts the data has (rlctl.recipes.rl.stream)."""
    if agent_enabled(cfg) and cfg.agent.max_turns is None:
        cfg.agent.max_turns = DEFAULT_MAX_TURNS
    if cfg.method in ("grpo", "ppo"):
        a, batch = cfg.algo, cfg.train.batch_size
        a.mini_batch_size = min(a.mini_batch_size or batch, batch)
