"""Reasons in words: why an attempt is not a good fit, the layout of an attempt, the rollout choices."""

from __future__ import annotations

from rlctl.estimate.memory import GIB, MemoryEstimate, MemorySettings
from rlctl.plan import rules
from rlctl.plan.inputs import Job
from rlctl.plan.search import Rejected, kv_target


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


def rejected_reason(r: Rejected) -> str:
    """One line for an option the search passed over: its closest attempt and why it fell short."""
    tried = f" (the closest of {r.layouts} layouts)" if r.layouts > 1 else ""
    return f"rejected {r.option.label}, {describe_layout(r.closest.settings)}{tried}: {why_not(r.closest)}"


def rollout_reasons(job: Job, est: MemoryEstimate, kv_short: bool, reasons: list[str], warnings: list[str]) -> None:
    s = est.settings
    target = kv_target(s)
    weights = est.phases["rollout"].components["engine_weights"] / GIB
    one_copy = job.device == "cpu" or rules.parallel.rollout_engine_tp_problem(job.engine, 2) is not None
    if one_copy:  # CPU; hf and sglang anywhere
        reasons.append(f"rollout tp 1: the {job.engine} engine runs one copy per rank")
    if job.engine == "hf" or job.device == "cpu":
        return
    if not job.cfg.rollout.tp and not one_copy:
        reasons.append(
            f"rollout tp {s.rollout_tp}: the smallest that holds the weights ({weights:.1f} GiB per GPU) "
            f"and a KV cache for {est.kv_cache_sequences} sequences (target {target}: an engine's share of the batch)"
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
