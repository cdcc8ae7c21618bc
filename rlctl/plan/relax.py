"""Relax a plan that fits: the plain module on one GPU, checkpointing off (or selective) and a larger micro
batch while the update still fits comfortably; each change recorded as a :class:`~rlctl.plan.types.Decision`.
"""

from __future__ import annotations

from dataclasses import replace

from rlctl.estimate.memory import GIB, MemoryEstimate, MemorySettings, estimate_memory
from rlctl.plan import rules
from rlctl.plan.inputs import Job
from rlctl.plan.types import Decision


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
    return rules.limit_text(job.memory, "comfort")


def _free(job: Job, est: MemoryEstimate) -> str:
    return f"{(job.memory - est.phases['training'].total_bytes) / GIB:.1f} GiB of the GPU stay free"


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
        why = (
            f"activation checkpointing off: without it the update needs {need:.1f} GiB, within {limit}; "
            f"{_free(job, off)}"
        )
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
                f"{selective.phases['training'].total_bytes / GIB:.1f} GiB, within {limit}; {_free(job, selective)}; "
                f"without checkpointing {need:.1f} GiB"
            )
            decisions.append(Decision("parallel.selective_checkpointing", True, why))
            return selective.settings
    why = f"activation checkpointing on: without it the update needs {need:.1f} GiB, over {limit}"
    decisions.append(Decision("parallel.activation_checkpointing", True, why))
    return s


def _relax_micro_batch(job: Job, s: MemorySettings, decisions: list[Decision]) -> MemorySettings:
    """The largest candidate micro batch that fits comfortably, within a step's sequences and the token cap."""
    mb = rules.tiers()["micro_batch"]
    per_gpu = job.sequences_per_gpu(s.dp)
    tokens = s.seq_len * s.seqs_per_unit  # dpo / rm: a micro batch counts pairs of two sequences
    unit = "pairs" if s.seqs_per_unit > 1 else "sequences"
    chosen = 1
    for c in mb["candidates"]:
        if c > per_gpu or c * tokens > mb["max_tokens"] or c == 1:
            continue
        if _comfortable(estimate_memory(job.spec, job.gpu, replace(s, micro_batch=c))):
            chosen = c
            break
    why = (
        f"micro batch {chosen}: the largest of {', '.join(map(str, mb['candidates']))} within "
        f"{_comfort_limit(job)}, <= {per_gpu} {unit} per GPU per step and <= {mb['max_tokens']} tokens "
        f"({tokens} per {unit[:-1]})"
    )
    if tokens > mb["max_tokens"]:  # one sequence (pair) is over the token target already: one at a time
        one = unit[:-1]
        why = (
            f"micro batch 1: one {one} is {tokens} tokens, over the {mb['max_tokens']}-token target of a "
            f"micro batch already, so one {one} at a time"
        )
    decisions.append(Decision("train.micro_batch_size", chosen, why))
    return replace(s, micro_batch=chosen)
