"""The planner's decisions in words: what the search passed over and why, the layout, Ulysses SP, offload,
the rollout and its split, and the warnings about the backend; each a :class:`~rlctl.plan.types.Decision`.
"""

from __future__ import annotations

from dataclasses import replace

from rlctl.estimate.memory import GIB, MemoryEstimate, MemorySettings, estimate_memory
from rlctl.estimate.settings import ALLOCATOR_SLACK
from rlctl.plan import rules
from rlctl.plan.inputs import OPTIONAL_PACKAGES, Job, LocalEnv
from rlctl.plan.search import SearchResult, _sp_sizes, _update_ok, kv_target
from rlctl.plan.types import Decision


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
            f"the KV cache holds {est.kv_cache_sequences} sequences, fewer than the {kv_target(est.settings)} of "
            "an engine's share of the batch"
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
    # the winner runs but falls short (its KV cache, the margin): the others are no rejects, only later choices
    short = why_not(result.est) if result.est.fits else "fits"
    first = result.option.label
    if short != "fits":
        why = f"no option is a good fit: {first}, the first in order of preference, falls short too ({short})"
        out.append(Decision("search", first, why))
    for r in result.rejected:
        if r.option == result.option:
            continue
        tried = f" (the closest of {r.layouts} layouts)" if r.layouts > 1 else ""
        why = f"rejected {r.option.label}, {describe_layout(r.closest.settings)}{tried}: {why_not(r.closest)}"
        if short != "fits":  # the winner falls short as well: say why it still comes first
            why = (
                f"passed over {r.option.label}, {describe_layout(r.closest.settings)}{tried}: short too "
                f"({why_not(r.closest)}); {first} comes first in order of preference"
            )
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
        f"GPU, the update {one.phases['training'].total_bytes / GIB:.1f} GiB, over {rules.limit_text(job.memory)}; "
        f"sp {s.sp} splits each sequence over {s.sp} GPUs: activations {_gib(est, 'activations')} GiB, "
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
        f"still need {top.phases['training'].total_bytes / GIB:.1f} GiB for the update, over "
        f"{rules.limit_text(job.memory)}: activations {_gib(one, 'activations')} -> {_gib(top, 'activations')} GiB, "
        f"logits {_gib(one, 'logits')} -> {_gib(top, 'logits')} GiB"
    )
    return Decision("parallel.sp", 1, why)


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


def eval_fraction_decision(job: Job, s: MemorySettings, fraction: float) -> list[Decision]:
    """A split run's evaluation engine on the trainer GPUs (:func:`rlctl.plan.search.eval_fraction`)."""
    if not fraction or job.cfg.rollout.eval_mem_fraction:
        return []
    why = (
        f"evaluation memory fraction {fraction:.2f}: a split run evaluates on its trainer GPUs, where the "
        f"trainer's resident states leave this much (the rollout GPUs' {s.mem_fraction:.2f} would not fit)"
    )
    return [Decision("rollout.eval_mem_fraction", fraction, why)]


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
