"""What a split run (``rollout.procs``: one-step-off-policy, streaming) runs with, and where a rollout engine's
tensor parallelism may go."""

from __future__ import annotations

from rlctl.catalog import parallel
from rlctl.names import RL_METHODS
from rlctl.support.table import JobFacts, Problem, rule

SPLIT_FLAG = "--rollout-procs"

# ---------------------------------------------------------------------------------------------
# One-step-off-policy: the split (rollout.procs)


@rule(r"max_staleness\s*<\s*0", r"procs\s*<\s*0")
def split_values(f: JobFacts) -> Problem | None:
    if f.max_staleness < 0:
        return Problem(
            "split_values",
            f"rollout.max_staleness={f.max_staleness} must be >= 0",
            "(0: synchronous; 1: one step behind)",
            " ",
        )
    if f.rollout_procs < 0:
        return Problem(
            "split_values",
            f"rollout.procs={f.rollout_procs} must be >= 0",
            "(0: no split; N: N processes only generate)",
            " ",
        )
    return None


@rule(r"method\s+not\s+in\s*\('grpo',?\)", r"is not supported with \S*rollout-procs")
def split_method(f: JobFacts) -> Problem | None:
    if f.rollout_procs and f.method != "grpo":
        why = "has no rollout)" if f.method not in RL_METHODS else "trains a critic, not split yet)"
        return Problem(
            "split_method", f"{f.method} is not supported with {SPLIT_FLAG}", f"(only grpo: {f.method} {why}", " "
        )
    return None


@rule(r"procs\s*>=", r"<=\s*[\w.]*procs\b", r"0\s*<\s*[\w.]*procs\s*<", r"leaves no trainer")
def split_trainer(f: JobFacts) -> Problem | None:
    if f.rollout_procs and f.world < 2:
        return Problem(
            "split_trainer",
            f"{SPLIT_FLAG} {f.rollout_procs} needs at least 2 processes (1 to generate, 1 to train)",
            "add --nproc 2",
            ": ",
        )
    if f.rollout_procs and f.rollout_procs >= f.world:
        return Problem(
            "split_trainer",
            f"{SPLIT_FLAG} {f.rollout_procs} leaves no trainer among the {f.world} processes",
            f"use at most {f.world - 1}",
            ": ",
        )
    return None


@rule(r"procs.{0,60}nodes\s*>\s*1", r"runs on one node")
def split_nodes(f: JobFacts) -> Problem | None:
    if f.rollout_procs and f.nodes > 1:
        return Problem("split_nodes", f"{SPLIT_FLAG} runs on one node ({f.nodes} given)", "use --nodes 1", ": ")
    return None


@rule(r"procs.{0,60}\.tp\s*>\s*1", r"one rollout engine per process")
def split_rollout_tp(f: JobFacts) -> Problem | None:
    if f.rollout_procs and f.rollout_tp > 1:
        return Problem(
            "split_rollout_tp",
            f"{SPLIT_FLAG} runs one rollout engine per process (rollout.tp={f.rollout_tp})",
            "use --rollout-tp 1",
            ": ",
        )
    return None


@rule(r"procs.{0,60}backend\s*==\s*'megatron'", r"trains with the FSDP engine only")
def split_megatron(f: JobFacts) -> Problem | None:
    if f.rollout_procs and f.backend == "megatron":
        return Problem(
            "split_megatron",
            f"{SPLIT_FLAG} trains with the FSDP engine only (backend megatron)",
            "use --backend fsdp",
            ": ",
        )
    return None


@rule(
    r"procs.{0,60}\bsp\b", r"\bsp\b.{0,60}\bprocs\b", r"has not been built or tested|runs without sequence parallelism"
)
def split_sp(f: JobFacts) -> Problem | None:
    if f.rollout_procs and f.sp > 1:
        return Problem(
            "split_sp",
            f"parallel.sp={f.sp} with rollout.procs={f.rollout_procs} (one-step-off-policy) has not been built or "
            "tested",
            "use one of them",
        )
    return None


@rule(r"(is_vl|vision)\b.{0,60}(procs|split\b)", r"procs.{0,60}is_vl", r"runs text models only")
def split_vision(f: JobFacts) -> Problem | None:
    if f.rollout_procs and f.vision:
        return Problem(
            "split_vision",
            f"{SPLIT_FLAG} runs text models only (a vision-language model's images are not sent to the rollout "
            "processes yet)",
            f"drop {SPLIT_FLAG} for this model",
        )
    return None


@rule(r"procs.{0,60}(needs_greedy|dynamic_sampling)", r"generate one batch per step, sampled only")
def split_sampling(f: JobFacts) -> Problem | None:
    if f.rollout_procs and f.sampling_only:
        return Problem(
            "split_sampling",
            f"{f.sampling_only} does not run with rollout.procs={f.rollout_procs} (one-step-off-policy: the rollout "
            "processes generate one batch per step, sampled only)",
            "set rollout.procs=0",
        )
    return None


@rule(r"%\s*[\w.]*rollout_tp\b", r"rollout tp .{0,40}must divide", r"does not divide the .{0,20}GPUs")
def rollout_tp_world(f: JobFacts) -> Problem | None:
    """Each rollout engine spans rollout.tp GPUs: the engines tile the GPUs (``rollout_tp`` 0: the plan's)."""
    if f.rollout_tp > 1 and f.world % f.rollout_tp:
        ok = ", ".join(str(t) for t in parallel.POWERS_OF_TWO if t <= f.world and f.world % t == 0)
        return Problem(
            "rollout_tp_world",
            f"rollout.tp={f.rollout_tp} does not divide the {f.world} GPUs",
            f"valid rollout tp: {ok}",
        )
    return None


@rule(r"%\s*[\w.]*tp\b.{0,60}across nodes", r"would split a rollout engine across nodes")
def rollout_tp_node(f: JobFacts) -> Problem | None:
    """A vLLM/SGLang engine runs tensor parallel inside one node, never across: its ranks are consecutive
    (torchrun numbers a node's processes consecutively), so its tp divides the processes of a node."""
    per_node = f.world // max(f.nodes, 1)
    if f.rollout_tp > 1 and per_node % f.rollout_tp:
        return Problem(
            "rollout_tp_node",
            f"rollout.tp={f.rollout_tp} would split a rollout engine across nodes ({per_node} processes per node)",
            f"tensor parallel stays inside a node: use a rollout.tp that divides {per_node} (--set rollout.tp=N)",
        )
    return None


# ---------------------------------------------------------------------------------------------
# Streaming RL (rollout.mode = "stream", docs/async.md)


@rule(r"mode\s*(!=|==)\s*'stream'.*procs", r"stream_chunk\s*<\s*1", r"several rollout processes stream")
def split_stream(f: JobFacts) -> Problem | None:
    """Stream mode: rollout processes, any number of them on the hf engine, single- or multi-turn (one global
    admission, rlctl.recipes.rl.streaming); vLLM / SGLang with one (several not run yet)."""
    if f.rollout_mode != "stream":
        return None
    flag = "--rollout-mode stream"
    if not f.rollout_procs:
        return Problem("split_stream", f"{flag} streams from rollout processes", "add --rollout-procs 1", ": ")
    if f.rollout_procs > 1 and f.rollout_engine != "hf":
        return Problem(
            "split_stream",
            f"several rollout processes stream with the hf engine only (--rollout {f.rollout_engine}, {SPLIT_FLAG} "
            f"{f.rollout_procs})",
            "use --rollout-procs 1 or --rollout hf",
            ": ",
        )
    if f.stream_chunk < 1:
        why = f"rollout.stream_chunk={f.stream_chunk} must be >= 1"
        return Problem("split_stream", why, "(tokens between weight checks; 32 by default)", " ")
    return None  # dynamic sampling needs every group of a step at once: split_sampling refuses it with any split


#: what a split run supports, in the order the pre-launch check asks (the planner asks split_sp, split_vision
#: and the algorithm check split_sampling earlier)
SPLIT_RULES = (
    "split_values",
    "split_stream",
    "split_method",
    "split_trainer",
    "split_nodes",
    "split_rollout_tp",
    "split_megatron",
)
