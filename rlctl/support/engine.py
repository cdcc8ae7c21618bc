"""What the training engines run with: Megatron's sizes and what it does not run yet, the FSDP engine's
precision and sharding, Ulysses sequence parallelism."""

from __future__ import annotations

from rlctl.catalog import parallel
from rlctl.names import PAIR_METHODS
from rlctl.support.table import JobFacts, Problem, rule

# ---------------------------------------------------------------------------------------------
# The Megatron engine


def megatron_gap(f: JobFacts) -> str | None:
    """What of this job rlctl's Megatron engine does not run yet (None: it runs all of it)."""
    if f.vision:
        return "a vision-language model"
    if f.method == "ppo":
        return "a PPO critic"
    if f.method in PAIR_METHODS:
        return f"rlctl {f.method}"
    return "LoRA" if f.lora else None


@rule(r"needs the Megatron engine, which", r"runs on the FSDP engine:", r"Megatron engine trains text models only")
def megatron_forced(f: JobFacts) -> Problem | None:
    """A job the Megatron engine cannot run, with Megatron or its sizes configured (unset, the planner takes
    FSDP2 and says so)."""
    missing = megatron_gap(f)
    sizes = (("tp", f.tp), ("pp", f.pp), ("ep", f.ep))
    forced = ["parallel.backend=megatron"] * (f.backend == "megatron")
    forced += [f"parallel.{k}={v}" for k, v in sizes if v > 1]
    if missing and forced:
        return Problem(
            "megatron_forced",
            f"{', '.join(forced)} needs the Megatron engine, which does not run {missing} yet",
            "use parallel.backend=fsdp (tp = pp = ep = 1)",
        )
    return None


@rule(
    r"backend\s*==\s*'fsdp'.{0,60}\(\s*[\w.]*tp,\s*[\w.]*pp",
    r"fsdp shards over all GPUs",
    r"no tensor, pipeline, expert",
)
def fsdp_layout(f: JobFacts) -> Problem | None:
    """The FSDP engine shards over every GPU: no tensor, pipeline, expert or context parallelism."""
    sizes = {"tp": f.tp, "pp": f.pp, "ep": f.ep, "cp": f.cp}
    over = [(k, v) for k, v in sizes.items() if v > 1]
    if f.backend == "fsdp" and over:
        key, value = over[0]
        return Problem(
            "fsdp_layout",
            f"parallel.{key}={value} needs parallel.backend=megatron",
            "the fsdp engine has no tensor, pipeline, expert or context parallelism (FSDP+TP is not built): set it "
            "to 1, or for long sequences use Ulysses sequence parallelism (--sp)",
        )
    return None


@rule(r"pipeline_split\([^()]*\)\s+is\s+None", r"cannot split the .{0,40}layers")
def megatron_pp(f: JobFacts) -> Problem | None:
    """Pipeline stages hold whole layers: even stages, only the last may hold fewer (``pp`` 0: the plan's)."""
    if f.pp > 1 and f.layers and parallel.pipeline_split(f.layers, f.pp) is None:
        of = f" of {f.model}" if f.model else ""
        return Problem(
            "megatron_pp",
            f"parallel.pp={f.pp} cannot split the {f.layers} layers{of} into even stages (only the last may be "
            "lighter)",
            f"valid pp: {', '.join(map(str, parallel.valid_pps(f.layers)))}",
        )
    return None


@rule(r"world_problem\(", r"cannot be split into tp", r"tp x pp x cp must divide")
def megatron_grid(f: JobFacts) -> Problem | None:
    """Megatron's ranks hold whole tp x pp x cp model replicas: the product divides the GPUs (sizes 0: 1)."""
    tp, pp = f.tp or 1, f.pp or 1
    if parallel.world_problem(f.world, tp, pp, f.cp):
        unit = tp * pp * f.cp
        ok = ", ".join(str(d) for d in range(1, f.world + 1) if f.world % d == 0)
        return Problem(
            "megatron_grid",
            f"{f.world} GPUs cannot be split into tp {tp} x pp {pp} x cp {f.cp} = {unit}",
            f"tp x pp x cp must divide the GPU count ({ok})",
        )
    return None


@rule(r"num_experts\s*%\s*[\w.]*\bep\b", r"is dense; expert parallelism", r"GPUs per (pipeline )?stage")
def megatron_ep(f: JobFacts) -> Problem | None:
    """Expert parallelism splits a MoE model's experts, inside each pipeline stage's GPUs (``ep`` 0: the plan's)."""
    if f.ep <= 1:
        return None
    if not f.experts:
        return Problem("megatron_ep", f"parallel.ep={f.ep}: {f.model} is dense", "expert parallelism needs a MoE model")
    per_stage = f.world // max(f.pp, 1)
    if f.experts % f.ep or per_stage % f.ep:
        ok = ", ".join(str(e) for e in parallel.POWERS_OF_TWO if f.experts % e == 0 and per_stage % e == 0)
        return Problem(
            "megatron_ep",
            f"parallel.ep={f.ep} must divide the {f.experts} experts and the {per_stage} GPUs per pipeline stage",
            f"valid ep: {ok}",
        )
    return None


# ---------------------------------------------------------------------------------------------
# Precision and sharding (the FSDP engine and the estimator)


@rule(
    r"(precision\s*==\s*'bf16'|pure_bf16).{0,60}dtype\s*!=\s*'bf16'",
    r"dtype\s*!=\s*'bf16'.{0,60}pure bf16",
    r"pure bf16\)? (training )?needs",
)
def pure_bf16_dtype(f: JobFacts) -> Problem | None:
    if f.precision == "bf16" and f.dtype != "bf16":
        return Problem(
            "pure_bf16_dtype",
            f"train.precision=bf16 (pure bf16) needs model.dtype=bf16, not {f.dtype}",
            "set model.dtype=bf16 or train.precision=mixed",
        )
    return None


@rule(r"not\s+[\w.]*shard\s+and\s+[\w.]*(gpus|world)\s*>\s*1", r"runs on one GPU, not|plain module on one device")
def no_shard_one_gpu(f: JobFacts) -> Problem | None:
    if not f.shard and f.world > 1:
        return Problem(
            "no_shard_one_gpu", f"shard=false (a plain module, no FSDP) runs on one GPU, not {f.world}", "keep sharding"
        )
    return None


# ---------------------------------------------------------------------------------------------
# Ulysses sequence parallelism (parallel.sp)


@rule(r"\bsp\b.{0,60}backend\s*!=\s*'fsdp'", r"backend\s*!=\s*'fsdp'.{0,60}\bsp\b", r"is the (FSDP|fsdp) engine's;")
def sp_backend(f: JobFacts) -> Problem | None:
    if f.sp > 1 and f.backend not in (None, "fsdp"):
        return Problem("sp_backend", f"parallel.sp={f.sp} is the FSDP engine's", "Megatron splits sequences with --cp")
    return None


@rule(
    r"\bsp\b.{0,60}attn\s+not\s+in\s*\(None,\s*'sdpa'\)", r"attn\s+not\s+in\s*\(None,\s*'sdpa'\).{0,60}\b(sp|Ulysses)\b"
)
def sp_attn(f: JobFacts) -> Problem | None:
    """Under SP rlctl's own attention runs inside the all-to-alls, per document over the whole sequence
    (rlctl.engines.ulysses): flash-attn's varlen kernel (flash_attention_2, or unset on a GPU where
    flash-attn is installed) or sdpa. transformers' eager attention is not one of them."""
    if f.sp > 1 and f.attn not in (None, "sdpa", "flash_attention_2"):
        return Problem(
            "sp_attn",
            f"parallel.sp={f.sp} runs attention per document with flash-attn's varlen kernel or sdpa, not {f.attn}",
            "set model.attn=flash_attention_2 or sdpa (or leave it unset)",
        )
    return None


@rule(
    r"(is_vl|is_vision\w*|vision)\b.{0,60}\bsp\b",
    r"\bsp\b.{0,60}(is_vl|is_vision)",
    r"not split by sequence|3-D positions",
)
def sp_vision(f: JobFacts) -> Problem | None:
    if f.sp > 1 and f.vision:
        return Problem(
            "sp_vision",
            f"parallel.sp={f.sp}: {f.model} is a vision-language model, whose image tokens and 3-D positions are not "
            "split by sequence",
            "use parallel.sp=1",
        )
    return None


@rule(r"(?<!def )\bsp_problem\(")
def sp_size(f: JobFacts) -> Problem | None:
    """The SP size divides the ranks and the attention heads (KV heads: divide or are divided)."""
    problem = parallel.sp_problem(f.sp, f.world, f.heads, f.kv_heads) if f.sp > 1 else None
    if problem:
        ok = ", ".join(
            str(d) for d in parallel.divisors(f.world) if not parallel.sp_problem(d, f.world, f.heads, f.kv_heads)
        )
        return Problem("sp_size", f"parallel.sp={f.sp}: {problem} ({f.model} on {f.world} ranks)", f"valid sp: {ok}")
    return None


#: what keeps a job at sp 1 whatever the sizes (the planner then tries no other)
SP_REFUSALS = ("split_sp", "sp_attn", "sp_vision")
#: every SP rule, in the order a configured sp is checked
SP_RULES = ("split_sp", "sp_backend", "sp_attn", "sp_vision", "sp_size")
