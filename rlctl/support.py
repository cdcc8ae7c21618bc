"""What runs with what: every rule once, over one record of a job (:class:`JobFacts`).

Each rule is a pure function of the facts returning a :class:`Problem` (the one-line message and its fix)
or None. The planner, the estimator, the pre-launch checks and the ranks' guards build the facts they
have and ask the rules by name (:func:`refuse`, :func:`problems`); none restates a rule's condition
(``tests/layout/test_rules_once.py`` greps for copies). Torch-free; imports only layer-0 facts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlctl.catalog import parallel
from rlctl.errors import UserError
from rlctl.names import PAIR_METHODS, RL_METHODS

if TYPE_CHECKING:
    from rlctl.catalog.spec import ModelSpec
    from rlctl.config.schema import RunConfig

SPLIT_FLAG = "--rollout-procs"


@dataclass(frozen=True)
class JobFacts:
    """A job as the rules see it. Each caller fills what it knows; the rules it asks read only those."""

    method: str = "grpo"
    world: int = 1  # processes in total (a split run's trainers and rollout processes)
    nodes: int = 1
    backend: str | None = "fsdp"  # None: not chosen (yet)
    dtype: str | None = "bf16"
    precision: str = "mixed"  # mixed | bf16 (pure bf16)
    shard: bool = True  # FSDP2 wrappers; False: the plain module
    tp: int = 0  # Megatron's sizes as configured (0: the plan's)
    pp: int = 0
    ep: int = 0
    cp: int = 1
    lora: bool = False
    sp: int = 1
    attn: str | None = None  # as configured (None: the plan's or the engine's choice)
    rollout_procs: int = 0
    rollout_tp: int = 0  # as configured (0: the plan's)
    max_staleness: int = 1
    rollout_mode: str = "fixed"  # fixed | stream (docs/async.md)
    stream_chunk: int = 32  # tokens between a stream's weight checks
    agent: bool = False  # --tools / --env / --interaction
    temperature: float = 1.0  # rollout.temperature
    samples: int = 1  # rollout.n: samples per prompt
    sampling_only: str = ""  # what needs more than sampled rollouts ("algo.dynamic_sampling", "--adv remax")
    behaviour_loss: str = ""  # a policy loss that weighs tokens by proximal / behaviour itself (decoupled), or ""
    correction: str | None = None  # algo.rollout_correction as configured (None: the default)
    model: str = ""
    vision: bool = False  # a vision-language model
    heads: int = 0  # attention heads (0: unknown)
    kv_heads: int | None = None  # None: MLA, or unknown

    @classmethod
    def of(cls, cfg: RunConfig, *, world: int = 1, nodes: int = 1, spec: ModelSpec | None = None, **kw) -> JobFacts:
        """The facts of a configuration on ``world`` processes over ``nodes`` nodes (``spec``: its model);
        ``kw`` overrides (e.g. the planner's backend)."""
        from rlctl.algos.registry import ADV_ESTIMATORS, POLICY_LOSSES

        a, r = cfg.algo, cfg.rollout
        greedy = cfg.method in RL_METHODS and a.adv in ADV_ESTIMATORS and ADV_ESTIMATORS[a.adv].needs_greedy
        loss = POLICY_LOSSES.get(a.policy_loss)
        facts = {
            **dict(method=cfg.method, world=world, nodes=nodes, backend=cfg.parallel.backend),
            **dict(dtype=cfg.model.dtype, precision=cfg.train.precision, shard=cfg.parallel.shard is not False),
            **dict(tp=cfg.parallel.tp, pp=cfg.parallel.pp, ep=cfg.parallel.ep, cp=cfg.parallel.cp),
            "lora": cfg.lora.rank > 0,
            **dict(sp=cfg.parallel.sp or 1, attn=cfg.model.attn, rollout_procs=r.procs, rollout_tp=r.tp),
            **dict(max_staleness=r.max_staleness, temperature=float(r.temperature), samples=int(r.n)),
            **dict(rollout_mode=r.mode, stream_chunk=r.stream_chunk),
            "agent": bool(cfg.agent.tools or cfg.agent.env or cfg.agent.interaction),
            "sampling_only": "algo.dynamic_sampling" if a.dynamic_sampling else f"--adv {a.adv}" if greedy else "",
            "behaviour_loss": a.policy_loss if loss is not None and loss.weighs_behaviour else "",
            "correction": a.rollout_correction,
            **(model_facts(spec) if spec is not None else {"model": cfg.model.name}),
        }
        return cls(**{**facts, **kw})


def model_facts(spec: ModelSpec) -> dict:
    """What the rules read of a model: its name, whether it takes images, its heads."""
    kv = None if spec.uses_mla else spec.num_kv_heads
    return dict(model=spec.name, vision=spec.is_vl, heads=spec.num_heads, kv_heads=kv)


@dataclass(frozen=True)
class Problem:
    """One rule broken: what is wrong and the fix, printed as one line ``message{sep}fix``."""

    rule: str
    message: str
    fix: str
    sep: str = "; "

    def __str__(self) -> str:
        return f"{self.message}{self.sep}{self.fix}"


@dataclass(frozen=True)
class Rule:
    name: str
    check: Callable[[JobFacts], Problem | None]
    # regular expressions over the code of every other module (docstrings dropped, as ast.unparse writes it)
    # that would restate the rule's condition (tests/layout/test_rules_once.py)
    restated: tuple[str, ...] = ()


RULES: dict[str, Rule] = {}


def rule(*restated: str):
    """Put the decorated check in :data:`RULES` under its name, with the patterns of a copy of it."""

    def register(check: Callable[[JobFacts], Problem | None]):
        name = check.__name__
        RULES[name] = Rule(name, check, restated)
        return check

    return register


def problems(facts: JobFacts, *names: str) -> list[Problem]:
    """The problems of ``facts`` under the rules ``names``, in that order."""
    out = [RULES[n].check(facts) for n in names]
    return [p for p in out if p is not None]


def refuse(facts: JobFacts, *names: str) -> None:
    """The first rule of ``names`` that ``facts`` break, as a one-line UserError."""
    found = problems(facts, *names)
    if found:
        raise UserError(str(found[0]))


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


@rule(
    r"is_vl\s+and\s+[\w.]*method\s*==\s*'ppo'",
    r"vision\s+and\s+role\s*==\s*'critic'",
    r"cannot be a PPO critic|critic, which a vision",
)
def critic_vision(f: JobFacts) -> Problem | None:
    if f.method == "ppo" and f.vision:
        return Problem(
            "critic_vision", "ppo trains a critic, which a vision-language model cannot be yet", "use grpo (no critic)"
        )
    return None


@rule(r"'grpo'.{0,60}temperature\)?\s*==\s*0", r"temperature 0 with grpo")
def greedy_groups(f: JobFacts) -> Problem | None:
    """GRPO compares the samples of a prompt: greedy ones are all the same, every advantage 0."""
    if f.method == "grpo" and f.temperature == 0.0 and f.samples > 1:
        return Problem(
            "greedy_groups",
            "--temperature 0 with grpo: the n responses to a prompt are all the same greedy one, so every "
            "advantage is 0 and nothing is learned",
            "sample with --temperature 1.0 (0.6 or more)",
        )
    return None


@rule(r"weighs_behaviour.{0,80}rollout_correction\s*in", r"would weigh each token twice")
def behaviour_weighed_twice(f: JobFacts) -> Problem | None:
    """Decoupled PPO weighs each token by proximal / behaviour, the ratio the rollout correction weighs by."""
    if f.behaviour_loss and f.correction in ("tis", "mis"):
        return Problem(
            "behaviour_weighed_twice",
            f"--policy-loss {f.behaviour_loss} weighs each token by proximal / behaviour itself; "
            f"algo.rollout_correction={f.correction} would weigh each token twice",
            "drop algo.rollout_correction (unset or none), or use --policy-loss ppo with it",
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
    if f.sp > 1 and f.attn not in (None, "sdpa"):
        return Problem(
            "sp_attn", f"parallel.sp={f.sp} runs attention per document with sdpa, not {f.attn}", "set model.attn=sdpa"
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


@rule(r"procs.{0,60}(agent|tools|interaction)", r"does not run multi-turn agents")
def split_agents(f: JobFacts) -> Problem | None:
    if f.rollout_procs and f.agent:
        return Problem(
            "split_agents",
            f"{SPLIT_FLAG} does not run multi-turn agents yet (--tools / --env / --interaction)",
            "drop one of them",
            ": ",
        )
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


@rule(r"mode\s*(!=|==)\s*'stream'.*procs", r"stream_chunk\s*<\s*1")
def split_stream(f: JobFacts) -> Problem | None:
    if f.rollout_mode != "stream":
        return None
    flag = "--rollout-mode stream"
    if not f.rollout_procs:
        return Problem("split_stream", f"{flag} streams from rollout processes", "add --rollout-procs 1", ": ")
    if f.rollout_procs != 1:
        return Problem(
            "split_stream",
            f"{flag} runs one rollout process ({SPLIT_FLAG} {f.rollout_procs})",
            "use --rollout-procs 1",
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
    "split_agents",
    "split_rollout_tp",
    "split_megatron",
)
