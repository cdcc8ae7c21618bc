"""The planner: a configuration and a :class:`~rlctl.plan.inputs.LocalEnv` in, one :class:`Plan` out,
every open (None) choice made and recorded as a :class:`~rlctl.plan.types.Decision`. It reads top to bottom:
resolve the inputs, choose the backend, search the options, relax, explain.

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
import math
from dataclasses import dataclass, field, replace

from rlctl.catalog import active_params
from rlctl.config import RunConfig
from rlctl.errors import UserError
from rlctl.estimate.memory import GIB, MemoryEstimate, MemorySettings, estimate_memory
from rlctl.estimate.settings import ALLOCATOR_SLACK
from rlctl.plan import rules
from rlctl.plan.inputs import OPTIONAL_PACKAGES, Job, LocalEnv, resolve_job, settings_for
from rlctl.plan.types import Decision, Plan, Verdict


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
    if est.settings.sp > 1:
        sp_attention(job, est.settings.sp)
    if est.settings.rollout_procs:
        decisions.append(split_decision(job, est.settings))
    decisions += job.later
    if est.fits and not margin_ok(est):
        warnings.append(
            f"less than {rules.tiers()['memory']['margin_fraction']:.0%} of GPU memory to spare: "
            "an allocator's fragmentation may not fit; more GPUs or offload give room"
        )
    return _plan(job, est, decisions, warnings), job, result


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
    if p.backend is None and tier == "megatron" and (p.sp or 1) > 1:
        why = f"backend fsdp: parallel.sp={p.sp} is the FSDP engine's Ulysses sequence parallelism"
        decisions.append(Decision("parallel.backend", "fsdp", why))
        tier = "fsdp"
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
    rules.check_sp(
        job.spec, backend=tier, sp=p.sp, world=job.world, attn=cfg.model.attn, rollout_procs=cfg.rollout.procs
    )
    if job.spec.is_vl and cfg.method == "ppo":
        raise UserError("ppo trains a critic, which a vision-language model cannot be yet; use grpo (no critic)")
    if job.is_rl:
        rules.check_rollout_engine_tp(job.engine, cfg.rollout.tp)
    return tier


def backend_the_engine_runs(job: Job, tier: str, decisions: list[Decision]) -> str:
    """The backend, after what rlctl's Megatron engine cannot run yet: a PPO critic and LoRA go to FSDP2
    (with offload when needed, as the search decides); a Megatron backend or Megatron-only sizes set
    in the config are a UserError there."""
    c = job.cfg
    missing = (
        "a vision-language model"
        if job.spec.is_vl
        else "a PPO critic"
        if c.method == "ppo"
        else "LoRA"
        if c.lora.rank
        else None
    )
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
    decisions.append(
        Decision("parallel.backend", "fsdp", f"backend fsdp: the Megatron engine does not run {missing} yet: FSDP2")
    )
    return "fsdp"


# ---------------------------------------------------------------------------------------------
# 2. Search: the options, their layouts and rollout TPs, the first that fits with the margin


def gpu_margin_ok(est: MemoryEstimate) -> bool:
    """The GPUs hold the job with the safety margin (estimates are not exact; allocators fragment)."""
    margin = rules.tiers()["memory"]["margin_fraction"]
    return est.engine_starts and est.peak_bytes <= est.gpu_memory_bytes * (1 - margin)


def margin_ok(est: MemoryEstimate) -> bool:
    """Fits, host memory included, with the GPU safety margin."""
    return est.fits and gpu_margin_ok(est)


def kv_target(s: MemorySettings) -> int:
    """Sequences a useful KV cache holds at once: an engine's share of the batch, capped."""
    share = math.ceil(s.rollout_batch * s.rollout_n / (s.gpus // s.rollout_tp))
    return min(share, rules.tiers()["rollout"]["kv_target_sequences"])


def kv_ok(est: MemoryEstimate) -> bool:
    return not est.settings.is_rl or est.kv_cache_sequences >= kv_target(est.settings)


def good_fit(plan: Plan) -> bool:
    """Fits with the safety margin and (RL) a KV cache that holds an engine's share of the batch:
    the bar `--what-to-rent` and "what would fit" use."""
    return margin_ok(plan.estimate) and kv_ok(plan.estimate)


@dataclass(frozen=True)
class Option:
    """One way to run the update: a backend and what it offloads."""

    backend: str
    offload_params: bool = False
    offload_optimizer: bool = False
    offload_activations: bool = False  # FSDP: saved activations in host memory (before offloading states)

    @property
    def offloads(self) -> bool:
        return self.offload_params or self.offload_optimizer

    @property
    def cost(self) -> int:
        """Preference rank: no offload, then Megatron's optimizer offload, then FSDP2 offloading every
        state (the CPU steps the whole optimizer)."""
        if not self.offloads:
            return 2 if self.offload_activations else 0
        if self.backend == "fsdp":
            return 4 if self.offload_activations else 3
        return 1 + (self.offload_params and self.offload_optimizer)

    @property
    def label(self) -> str:
        if self.backend == "fsdp":
            saver = " and activation offload" if self.offloads else " with activation offload"
            return ("fsdp with CPU offload" if self.offloads else "fsdp") + (saver if self.offload_activations else "")
        parts = ["optimizer CPU offload"] if self.offload_optimizer else []
        parts += ["weights offloaded during rollout"] if self.offload_params else []
        return "megatron" + (" with " + " and ".join(parts) if parts else "")


@dataclass
class Rejected:
    option: Option
    closest: MemoryEstimate  # its attempt nearest to a good fit
    layouts: int  # layouts tried


@dataclass
class SearchResult:
    est: MemoryEstimate
    option: Option
    kv_short: bool = False  # fits, but the KV cache holds less than an engine's share of the batch
    rejected: list[Rejected] = field(default_factory=list)  # options tried before the winner (all when none fits)


def _offload_levels(job: Job, backend: str) -> list[tuple[bool, bool]]:
    """(offload_params, offload_optimizer) pairs to try, least offload first.

    FSDP2 offloads all sharded states at once (either flag); Megatron offloads its optimizer
    (megatron-core's ``optimizer_cpu_offload``). The Megatron engine does not move its weights off
    the GPU between RL phases yet, so that level is not planned (FSDP2 with offload comes next).
    CPU runs have nothing to offload. Flags set in the config are kept.
    """
    user_p, user_o = job.cfg.parallel.offload_params, job.cfg.parallel.offload_optimizer
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


def options_for(job: Job, tier: str) -> list[Option]:
    """The (backend, offload) options in order of preference.

    A Megatron-tier model tries Megatron, then FSDP2, each without offload, then Megatron with its
    optimizer on the CPU, then FSDP2 with CPU offload. A
    backend set in the config, or Megatron-only sizes (tp, pp, ep > 1), keep to that backend.
    """
    p = job.cfg.parallel
    if p.backend is not None:
        backends = [p.backend]
    elif tier == "megatron" and job.device == "cuda" and max(p.tp, p.pp, p.ep) <= 1:
        backends = ["megatron", "fsdp"]
    else:
        backends = [tier]
    options = [Option(b, *level) for b in backends for level in _offload_levels(job, b)]
    acts = p.offload_activations
    if acts:
        options = [replace(o, offload_activations=o.backend == "fsdp") for o in options]
    elif acts is None and job.device == "cuda":
        # activation offload (pinned host memory, copies overlap the compute): after the same option without it
        options += [replace(o, offload_activations=True) for o in options if o.backend == "fsdp"]
    return sorted(options, key=lambda o: o.cost)  # stable: Megatron before FSDP2 at the same cost


Layout = tuple[int, int, int, int]  # (tp, pp, ep, sp)


def _search_order(job: Job, options: list[Option]) -> list[tuple[Option, Layout, int]]:
    """(option, (tp, pp, ep, sp), rollout TP) in the order tried: rollout TP inside a node before any offload
    (option, then layout, then TP); a rollout TP across nodes after every option (TP first)."""
    tps = _rollout_tps(job)
    inside, across = [t for t in tps if t <= job.nproc], [t for t in tps if t > job.nproc]
    layouts = {o.backend: _layouts(job, o.backend) for o in options}
    order = [(o, lay, t) for o in options for lay in layouts[o.backend] for t in inside]
    return order + [(o, lay, t) for t in across for o in options for lay in layouts[o.backend]]


def _layouts(job: Job, backend: str) -> list[Layout]:
    """FSDP: each Ulysses sequence-parallel size, smallest first; Megatron: its (tp, pp, ep) layouts."""
    p = job.cfg.parallel
    if backend == "fsdp":
        return [(1, 1, 1, sp) for sp in _sp_sizes(job)]
    layouts = rules.megatron_layouts(job.spec, world=job.world, per_node=job.nproc, tp=p.tp, pp=p.pp, ep=p.ep, cp=p.cp)
    return [(tp, pp, ep, 1) for tp, pp, ep in layouts]


def _sp_sizes(job: Job) -> list[int]:
    """Ulysses SP sizes to try: as configured, else 1 then each size inside a node (the all-to-all of every
    layer wants the node's links) that the heads, the ranks and the job allow (rlctl.plan.rules.sp_sizes)."""
    sp = job.cfg.parallel.sp
    if sp is not None:
        return [sp]
    return rules.sp_sizes(job.spec, world=job.world, per_node=job.nproc, refused=rules.sp_refusal(job.cfg))


def _rollout_tps(job: Job) -> list[int]:
    if not job.is_rl:
        return [1]
    if job.cfg.rollout.tp:
        return [job.cfg.rollout.tp]
    if rules.parallel.rollout_engine_tp_problem(job.engine, 2) or job.device == "cpu":
        return [1]  # hf and SGLang run one copy per rank
    # vLLM tensor parallelism stays inside a node (the launcher refuses a group across nodes)
    return rules.rollout_tps(job.spec, min(job.world, job.nproc))


def search(job: Job, options: list[Option]) -> SearchResult:
    """The preferred (option, layout, rollout TP) whose estimate fits with the margin.

    Preference: rollout TP inside a node before any offload, offload before a rollout TP that
    spans nodes; then the option order (:func:`options_for`), the layout order, the smaller rollout
    TP. A combination whose KV cache is short of an engine's share of the batch, or that fits only
    without the margin, is kept as a fallback. Every option before the winner is reported with the
    attempt that came closest.
    """
    fallback: SearchResult | None = None
    closest: dict[Option, MemoryEstimate] = {}
    tried: dict[Option, set] = {}
    update_fits: dict[tuple, bool] = {}
    sp_needed: dict[Option, bool] = {}
    for option, layout, rollout_tp in _search_order(job, options):
        key = (option, layout)
        if update_fits.get(key) is False:
            continue  # the update does not depend on the rollout TP
        if layout[3] > 1 and job.cfg.parallel.sp is None:
            if option not in sp_needed:
                sp_needed[option] = _sp_needed(job, option, rollout_tp)
            if not sp_needed[option]:
                continue
        est, update_fits[key] = _attempt(job, option, layout, rollout_tp)
        if option not in closest or _shortfall(est) < _shortfall(closest[option]):
            closest[option] = est
        tried.setdefault(option, set()).add(layout)
        if not update_fits[key] or not est.fits:
            continue
        if not margin_ok(est):
            fallback = fallback or SearchResult(est, option)
        elif not kv_ok(est):
            if fallback is None or not fallback.kv_short:
                fallback = SearchResult(est, option, kv_short=True)
        else:
            before = options[: options.index(option)]
            return SearchResult(
                est, option, rejected=[Rejected(o, closest[o], len(tried[o])) for o in before if o in closest]
            )
    rejected = [Rejected(o, closest[o], len(tried[o])) for o in options if o in closest]
    if fallback is not None:
        fallback.rejected = rejected
        return fallback
    best = min(rejected, key=lambda r: _shortfall(r.closest))
    return SearchResult(best.closest, best.option, rejected=rejected)


def _update_ok(est: MemoryEstimate) -> bool:
    """The update (training phase) fits the GPU with the safety margin."""
    return est.phases["training"].total_bytes <= est.gpu_memory_bytes * (1 - rules.tiers()["memory"]["margin_fraction"])


def _sp_needed(job: Job, option: Option, rollout_tp: int) -> bool:
    """Ulysses SP is tried for an option only when it makes the difference: the update does not fit with
    the margin at sp 1 and does at the largest size tried (otherwise the sequence is not the problem)."""
    sizes = _sp_sizes(job)
    one, _ = _attempt(job, option, (1, 1, 1, 1), rollout_tp)
    top, _ = _attempt(job, option, (1, 1, 1, sizes[-1]), rollout_tp)
    return not _update_ok(one) and _update_ok(top)


def _attempt(job: Job, option: Option, layout: Layout, rollout_tp: int) -> tuple[MemoryEstimate, bool]:
    """The estimate of one combination, and whether its update fits the GPU (without the margin)."""
    p, (tp, pp, ep, sp) = job.cfg.parallel, layout
    ckpt, sp_user = p.activation_checkpointing, p.sequence_parallel
    megatron = option.backend == "megatron"
    s = settings_for(
        job,
        backend=option.backend,
        tp=tp,
        pp=pp,
        ep=ep,
        sp=sp,
        sequence_parallel=(megatron and tp > 1) if sp_user is None else (sp_user and megatron),
        rollout_tp=rollout_tp,
        micro_batch=job.cfg.train.micro_batch_size or 1,
        activation_checkpointing=True if ckpt is None else ckpt,
        offload_params=option.offload_params,
        offload_optimizer=option.offload_optimizer,
        offload_activations=option.offload_activations,
        # the FSDP engine's savers as configured; Megatron has none of them
        selective_checkpointing=option.backend == "fsdp" and p.selective_checkpointing is True,
        shard=option.backend != "fsdp" or p.shard is not False,
    )
    if _plain_module(job, s):
        s = replace(s, shard=False)
    est = estimate_memory(job.spec, job.gpu, s)
    update_fits = est.phases["training"].total_bytes <= job.memory
    auto_fraction = job.is_rl and not job.cfg.rollout.mem_fraction and job.engine != "hf" and job.device == "cuda"
    if update_fits and auto_fraction:
        est = estimate_memory(job.spec, job.gpu, replace(s, mem_fraction=_auto_fraction(job, est)))
    return est, update_fits


def _plain_module(job: Job, s: MemorySettings) -> bool:
    """One GPU (or one CPU process) and nothing offloaded: the plain module (no FSDP wrappers) holds no
    gathered copies and runs no collectives or DTensor dispatch, so the search uses it unless
    parallel.shard is set."""
    return s.backend == "fsdp" and s.gpus == 1 and not s.cpu_offload and job.cfg.parallel.shard is None


def _auto_fraction(job: Job, est: MemoryEstimate) -> float:
    """The engine's memory fraction: what the trainer and the overheads leave, minus a margin."""
    r = rules.tiers()["rollout"]
    parts = est.phases["rollout"].components
    covered = {"engine_weights", "kv_cache"} | ({"engine_activations"} if est.settings.rollout == "vllm" else set())
    others = sum(v for k, v in parts.items() if k not in covered)
    room = (job.memory * (1 - rules.tiers()["memory"]["margin_fraction"]) - others) / job.memory
    step = r["fraction_step"]
    return round(max(step, min(r["max_mem_fraction"], math.floor(room / step + 1e-9) * step)), 4)


def _shortfall(est: MemoryEstimate) -> tuple[float, float, float]:
    """How far an estimate is from a good fit, for ordering attempts: first the memory overflow
    (GPU with the margin, or host; 1 when both fit), then the KV cache's shortfall, then how full."""
    margin = rules.tiers()["memory"]["margin_fraction"]
    full = est.peak_bytes / (est.gpu_memory_bytes * (1 - margin))
    if est.host_memory_bytes:
        full = max(full, est.host_bytes / est.host_limit_bytes)
    kv = kv_target(est.settings) / max(est.kv_cache_sequences, 0.5) if est.settings.is_rl else 0.0
    return max(full, 1.0), kv, full


# ---------------------------------------------------------------------------------------------
# 3. Relax: the plain module, checkpointing off and a larger micro batch while the update fits comfortably


def relax(job: Job, est: MemoryEstimate, decisions: list[Decision]) -> MemoryEstimate:
    """Turn checkpointing off and raise the micro batch while the update fits comfortably."""
    s = est.settings
    unshard = _unshard_decision(job, s)
    if unshard is not None:
        decisions.append(unshard)
    if job.cfg.parallel.activation_checkpointing is None and not s.offload_activations:
        s = _relax_checkpointing(job, s, decisions)
    if not job.cfg.train.micro_batch_size:
        s = _relax_micro_batch(job, s, decisions)
    return estimate_memory(job.spec, job.gpu, s)


def _comfortable(est: MemoryEstimate) -> bool:
    """The update leaves enough room to trade memory for speed (no checkpointing, larger batches)."""
    margin = rules.tiers()["memory"]["comfort_fraction"]
    return est.phases["training"].total_bytes <= est.gpu_memory_bytes * (1 - margin)


def _comfort_limit(job: Job) -> str:
    return f"{(1 - rules.tiers()['memory']['comfort_fraction']) * job.memory / GIB:.1f} GiB"


def _unshard_decision(job: Job, s: MemorySettings) -> Decision | None:
    if s.shard or job.cfg.parallel.shard is not None:
        return None
    if job.device != "cuda":
        why = (
            "shard off: one process, so the plain module without FSDP wrappers (no DTensor, no hooks; mixed "
            "precision by autocast, as on one GPU)"
        )
        return Decision("parallel.shard", False, why)
    saved = estimate_memory(job.spec, job.gpu, replace(s, shard=True)).phases["training"].total_bytes
    saved -= estimate_memory(job.spec, job.gpu, s).phases["training"].total_bytes
    why = (
        f"shard off: one GPU, so the plain module without FSDP wrappers ({saved / GIB:.1f} GiB of gathered "
        "layers less, no collectives)"
    )
    return Decision("parallel.shard", False, why)


def _relax_checkpointing(job: Job, s: MemorySettings, decisions: list[Decision]) -> MemorySettings:
    """Checkpointing off when the update fits comfortably without it; else (FSDP on GPUs, the savers not
    set) selective checkpointing when that fits comfortably; else on."""
    limit = _comfort_limit(job)
    off = estimate_memory(job.spec, job.gpu, replace(s, activation_checkpointing=False))
    need = off.phases["training"].total_bytes / GIB
    if _comfortable(off):
        why = f"activation checkpointing off: the update fits comfortably without it ({need:.1f} GiB <= {limit})"
        decisions.append(Decision("parallel.activation_checkpointing", False, why))
        return off.settings
    savers = s.backend == "fsdp" and job.device == "cuda" and job.cfg.parallel.selective_checkpointing is None
    if savers:
        selective = estimate_memory(
            job.spec, job.gpu, replace(s, activation_checkpointing=False, selective_checkpointing=True)
        )
        if _comfortable(selective):
            why = (
                f"selective activation checkpointing (the MLPs recomputed, attention kept): the update needs "
                f"{selective.phases['training'].total_bytes / GIB:.1f} GiB (comfortable: <= {limit}); without "
                f"checkpointing {need:.1f} GiB"
            )
            decisions.append(Decision("parallel.selective_checkpointing", True, why))
            return selective.settings
    why = f"activation checkpointing on: without it the update needs {need:.1f} GiB (comfortable: <= {limit})"
    decisions.append(Decision("parallel.activation_checkpointing", True, why))
    return s


def _relax_micro_batch(job: Job, s: MemorySettings, decisions: list[Decision]) -> MemorySettings:
    """The largest candidate micro batch that fits comfortably, within a step's sequences and the token cap."""
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
    why = (
        f"micro batch {chosen}: the largest of {', '.join(map(str, mb['candidates']))} that fits comfortably, "
        f"<= {per_gpu} sequences per GPU per step and <= {mb['max_tokens']} tokens ({tokens} per sequence)"
    )
    decisions.append(Decision("train.micro_batch_size", chosen, why))
    return replace(s, micro_batch=chosen)


# ---------------------------------------------------------------------------------------------
# 4. Explain: what the search passed over, the layout, offload, rollout; warnings


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
    if s.backend == "fsdp":
        text = f"dp {s.dp}" + (f" x sp {s.sp}" if s.sp > 1 else "")
    else:
        text = f"tp {s.tp} x pp {s.pp}" + (f" x ep {s.ep}" if s.ep > 1 else "")
    return text + (f", rollout tp {s.rollout_tp}" if s.is_rl else "")


def explain_search(tier: str, result: SearchResult) -> list[Decision]:
    """Each option passed over, with its closest attempt and why it fell short; the backend when the
    winner's differs from the tier."""
    out = []
    for r in result.rejected:
        if r.option == result.option:
            continue
        tried = f" (the closest of {r.layouts} layouts)" if r.layouts > 1 else ""
        why = f"rejected {r.option.label}, {describe_layout(r.closest.settings)}{tried}: {why_not(r.closest)}"
        out.append(Decision("rejected", r.option.label, why))
    backend = result.option.backend
    if backend != tier:
        how = "is the first option that fits" if result.est.fits else "comes closest (no option fits)"
        out.append(Decision("parallel.backend", backend, f"backend {backend}: {result.option.label} {how}"))
    return out


def backend_warnings(job: Job, backend: str, local: LocalEnv) -> list[str]:
    out = []
    if job.cfg.parallel.sequence_parallel is True and backend == "fsdp":
        out.append("parallel.sequence_parallel applies to Megatron with tp > 1; ignored with fsdp")
    if backend == "megatron" and job.spec.is_moe:
        out.append(
            f"the Megatron engine does not run MoE models yet ({job.spec.name}): rlctl's layout maps dense "
            "Qwen2/Qwen3/Llama/Mistral layers only, so this plan is an estimate that training cannot run"
        )
    if backend == "megatron" and job.device == "cuda" and "megatron" not in local.installed:
        out.append(
            f"megatron-core is not installed here: pip install '{OPTIONAL_PACKAGES['megatron']}' on the machines "
            "that run the job"
        )
    return out


def layout_decision(job: Job, s: MemorySettings) -> Decision:
    value = {"tp": s.tp, "pp": s.pp, "dp": s.dp, "ep": s.ep, "sp": s.sp, "sequence_parallel": s.sequence_parallel}
    if s.backend == "fsdp" and not s.sharded:
        one = "one GPU" if job.device == "cuda" else "one process"
        return Decision("parallel", value, f"parallel: {one}, the plain module (no FSDP): every state on it")
    if s.backend == "fsdp":
        why = (
            f"parallel: FSDP2 full shard, {describe_layout(replace(s, method='sft'))}: weights, gradients and "
            f"optimizer states split over {s.fsdp_shards} ranks"
        )
        return Decision("parallel", value, why)
    ep = f" x ep {s.ep}" if s.ep > 1 else ""
    why = f"parallel: tp {s.tp} x pp {s.pp} x dp {s.dp}{ep}: the most data-parallel layout whose update fits" + (
        ", sequence parallel on" if s.sequence_parallel else ""
    )
    return Decision("parallel", value, why)


def sp_decision(job: Job, est: MemoryEstimate) -> Decision | None:
    """Ulysses SP the search chose (not configured), and why: the update at sp 1 and at the chosen size, the
    activations that divide, the logits, the all-to-all buffers on top. At sp 1 when the update does not fit:
    why splitting the sequence was not enough either."""
    s = est.settings
    if job.cfg.parallel.sp is not None:
        return None
    one = estimate_memory(job.spec, job.gpu, replace(s, sp=1))
    if s.sp == 1:
        return _sp_not_enough(job, one)
    at = est.phases["training"]
    why = (
        f"sp {s.sp} (Ulysses sequence parallelism): at sp 1 a {one.settings.tokens_per_micro_batch}-token micro "
        f"batch needs {_gib(one, 'activations')} GiB of activations and {_gib(one, 'logits')} GiB of logits per "
        f"GPU, the update {one.phases['training'].total_bytes / GIB:.1f} GiB (the limit: {_limit(job) / GIB:.1f} "
        f"GiB); sp {s.sp} splits each sequence over {s.sp} GPUs: activations {_gib(est, 'activations')} GiB, "
        f"logits {_gib(est, 'logits')} GiB, all-to-all buffers {_gib(est, 'sp_all_to_all')} GiB, the update "
        f"{at.total_bytes / GIB:.1f} GiB"
    )
    return Decision("parallel.sp", s.sp, why)


def _gib(est: MemoryEstimate, key: str) -> str:
    return f"{est.phases['training'].components.get(key, 0) / GIB:.1f}"


def _limit(job: Job) -> float:
    return job.memory * (1 - rules.tiers()["memory"]["margin_fraction"])


def _sequence_overflows(job: Job, one: MemoryEstimate) -> bool:
    """The activations and logits (with the allocator's slack on them) are more than the update's overflow:
    splitting the sequence finely enough would make it fit, so the sequence is the problem."""
    parts = one.phases["training"].components
    divisible = (parts["activations"] + parts["logits"]) * (1 + ALLOCATOR_SLACK)
    return divisible > one.phases["training"].total_bytes - _limit(job)


def _sp_not_enough(job: Job, one: MemoryEstimate) -> Decision | None:
    """sp 1 although the update does not fit and its sequence is the problem: what the largest SP size would
    leave (None when the update fits, no SP size can run, or the sequence is not what overflows)."""
    sizes = _sp_sizes(job)
    if _update_ok(one) or len(sizes) == 1 or not _sequence_overflows(job, one):
        return None
    top = estimate_memory(job.spec, job.gpu, replace(one.settings, sp=sizes[-1]))
    if _update_ok(top):
        return None
    why = (
        f"sp 1: splitting each sequence over sp {sizes[-1]} GPUs (the most the heads and a node allow) would "
        f"still need {top.phases['training'].total_bytes / GIB:.1f} GiB for the update (the limit: "
        f"{_limit(job) / GIB:.1f} GiB): activations {_gib(one, 'activations')} -> {_gib(top, 'activations')} GiB, "
        f"logits {_gib(one, 'logits')} -> {_gib(top, 'logits')} GiB"
    )
    return Decision("parallel.sp", 1, why)


def sp_attention(job: Job, sp: int) -> None:
    """Ulysses SP runs attention with sdpa per document (rlctl.engines.ulysses): the plan's attention, its
    reason, and no flash-attn warning."""
    job.attn = "sdpa"
    job.later = [
        Decision("model.attn", "sdpa", f"attn sdpa: Ulysses sequence parallelism (sp {sp}) runs sdpa per document")
        if d.key == "model.attn"
        else d
        for d in job.later
    ]
    job.warnings[:] = [w for w in job.warnings if not w.startswith("flash-attn is not installed here")]


def offload_decisions(job: Job, s: MemorySettings) -> list[Decision]:
    """What a plan that fits offloads, and why (nothing to say for SFT without offload)."""
    p = job.cfg.parallel
    value = {"params": s.offload_params, "optimizer": s.offload_optimizer}
    user_p, user_o = p.offload_params, p.offload_optimizer
    if user_p is not None and user_o is not None:
        why = f"offload params {_word(user_p)}, optimizer {_word(user_o)}: as configured"
    elif s.cpu_offload:
        why = (
            "offload params and optimizer: fits only with FSDP2 CPU offload (sharded states on the CPU, "
            "the optimizer steps there; slower)"
        )
    elif s.offload_optimizer:
        weights = " and its weights on the CPU during rollout" if s.offload_params else ""
        why = (
            f"offload {'params and ' if s.offload_params else ''}optimizer: fits only with Megatron's optimizer "
            f"CPU offload{weights} (megatron-core optimizer_cpu_offload: fp32 master weights, gradient copies "
            "and AdamW states on the CPU, which steps the optimizer; slower)"
        )
    elif job.is_rl:
        why = "offload none: the rollout phase fits beside the trainer's states"
    else:
        return []
    return [Decision("offload", value, why)]


def _word(flag: bool) -> str:
    return "true" if flag else "false"


def rollout_decisions(
    job: Job, est: MemoryEstimate, kv_short: bool, decisions: list[Decision], warnings: list[str]
) -> None:
    """The rollout TP (1 where the engine runs one copy per rank) and memory fraction the search chose; a
    warning when the KV cache is short."""
    s = est.settings
    target = kv_target(s)
    weights = est.phases["rollout"].components["engine_weights"] / GIB
    one_copy = job.device == "cpu" or rules.parallel.rollout_engine_tp_problem(job.engine, 2) is not None
    if one_copy:  # CPU; hf and sglang anywhere
        decisions.append(Decision("rollout.tp", 1, f"rollout tp 1: the {job.engine} engine runs one copy per rank"))
    if job.engine == "hf" or job.device == "cpu":
        return
    if not job.cfg.rollout.tp and not one_copy:
        why = (
            f"rollout tp {s.rollout_tp}: the smallest that holds the weights ({weights:.1f} GiB per GPU) "
            f"and a KV cache for {est.kv_cache_sequences} sequences (target {target}: an engine's share of the batch)"
        )
        decisions.append(Decision("rollout.tp", s.rollout_tp, why))
    if not job.cfg.rollout.mem_fraction:
        why = (
            f"rollout memory fraction {s.mem_fraction:.2f}: what the trainer's resident states leave, "
            f"minus a {rules.tiers()['memory']['margin_fraction']:.0%} margin"
        )
        decisions.append(Decision("rollout.mem_fraction", s.mem_fraction, why))
    if kv_short:
        warnings.append(
            f"the KV cache holds {est.kv_cache_sequences} sequences at once, fewer than the {target} an engine "
            "generates per step: rollout runs in several waves (more GPUs or a larger rollout TP help)"
        )


def split_decision(job: Job, s) -> Decision:
    """One-step-off-policy (rollout.procs): the split, and when it pays (docs/offpolicy.md)."""
    r, unit = job.cfg.rollout, "GPUs" if job.device == "cuda" else "processes"
    value = {"rollout": s.rollout_procs, "train": s.gpus, "max_staleness": r.max_staleness}
    why = (
        f"rollout split: {s.rollout_procs} of {s.rollout_procs + s.gpus} {unit} only generate (inference weights "
        f"and KV cache), {s.gpus} only train (the training states), the rollout {r.max_staleness} update(s) "
        "behind, stale batches importance-corrected. It pays when a rollout and an update take comparable "
        "times and response lengths are long-tailed: the longest response sets a rollout's time, which "
        "more data-parallel ranks do not shorten, and the rollout hides behind the update. It does not when "
        "one phase dominates or lengths are even: the trainers lose the rollout devices' share of the "
        "update (docs/offpolicy.md)"
    )
    return Decision("rollout.procs", value, why)


def _plan(job: Job, est: MemoryEstimate, decisions: list[Decision], warnings: list[str]) -> Plan:
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
    """A copy of ``cfg`` with every field the plan decides (None or 0) filled in: the resolved
    config has no None left in parallel.*."""
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
    return out
