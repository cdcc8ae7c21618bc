"""The search: the (backend, offload) options in order of preference, each parallel layout, each rollout TP
size from the smallest; the first combination whose estimate fits with the margin (and whose KV cache holds an
engine's share of the batch) wins, every option before it reported with its closest attempt. The margin checks
here are also the bar of "what would fit" and `--what-to-rent` (rlctl.plan.advice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from rlctl.estimate.memory import MemoryEstimate, MemorySettings, estimate_memory
from rlctl.plan import rules
from rlctl.plan.inputs import Job, settings_for
from rlctl.plan.types import Plan
from rlctl.support import JobFacts, problems


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
        # a split run's trainers are FSDP2's (rlctl.support's split_megatron): Megatron is no option there
        split = job.cfg.rollout.procs
        backends = [
            b for b in ("megatron", "fsdp") if not problems(JobFacts(rollout_procs=split, backend=b), "split_megatron")
        ]
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
    return rules.sp_sizes(job.facts, per_node=job.nproc)


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


def eval_fraction(job: Job, est: MemoryEstimate) -> float:
    """A split run's evaluation engine sits on each TRAINER GPU, beside the trainer's resident states (its
    weights, optimizer states and reference model): the fraction a colocated run of the same trainers would
    get. The rollout GPUs' fraction (up to ``max_mem_fraction``, with nothing else there) would not fit:
    vLLM refuses to start when less than ``fraction x total`` is free. 0 when there is no such engine."""
    s = est.settings
    if not (job.is_rl and s.rollout_procs and job.engine != "hf" and job.device == "cuda"):
        return 0.0
    return _auto_fraction(job, estimate_memory(job.spec, job.gpu, replace(s, rollout_procs=0)))


def _shortfall(est: MemoryEstimate) -> tuple[float, float, float]:
    """How far an estimate is from a good fit, for ordering attempts: first the memory overflow
    (GPU with the margin, or host; 1 when both fit), then the KV cache's shortfall, then how full."""
    margin = rules.tiers()["memory"]["margin_fraction"]
    full = est.peak_bytes / (est.gpu_memory_bytes * (1 - margin))
    if est.host_memory_bytes:
        full = max(full, est.host_bytes / est.host_limit_bytes)
    kv = kv_target(est.settings) / max(est.kv_cache_sequences, 0.5) if est.settings.is_rl else 0.0
    return max(full, 1.0), kv, full
