"""The table's frame: the record of a job (:class:`JobFacts`), a broken rule (:class:`Problem`), the table
(:data:`RULES`, filled by :func:`rule`) and the two ways to ask it (:func:`refuse`, :func:`problems`).

Each rule is a pure function of the facts returning a :class:`Problem` (the one-line message and its fix)
or None. The planner, the estimator, the pre-launch checks and the ranks' guards build the facts they
have and ask the rules by name (:func:`refuse`, :func:`problems`); none restates a rule's condition
(``tests/layout/test_rules_once.py`` greps for copies). Torch-free; imports only layer-0 facts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlctl.errors import UserError
from rlctl.names import RL_METHODS

if TYPE_CHECKING:
    from rlctl.catalog.spec import ModelSpec
    from rlctl.config.schema import RunConfig


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
    rollout_engine: str = "hf"  # rollout.engine: hf | vllm | sglang
    agent: bool = False  # --tools / --env / --interaction
    distill: str = "sampled"  # algo.distill: sampled | full
    teacher_data: bool = False  # algo.teacher_data: some steps train on the teacher's own responses
    temperature: float = 1.0  # rollout.temperature
    samples: int = 1  # rollout.n: samples per prompt
    sampling_only: str = ""  # what needs more than sampled rollouts ("algo.dynamic_sampling", "--adv remax")
    behaviour_loss: str = ""  # a policy loss that weighs tokens by proximal / behaviour itself (decoupled), or ""
    correction: str | None = None  # algo.rollout_correction as configured (None: the default)
    model: str = ""
    vision: bool = False  # a vision-language model
    heads: int = 0  # attention heads (0: unknown)
    kv_heads: int | None = None  # None: MLA, or unknown
    layers: int = 0  # decoder layers (0: unknown)
    experts: int = 0  # a MoE model's routed experts (0: dense)

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
            **dict(rollout_mode=r.mode, stream_chunk=r.stream_chunk, rollout_engine=r.engine),
            "agent": bool(cfg.agent.tools or cfg.agent.env or cfg.agent.interaction),
            "distill": a.distill,
            "teacher_data": bool(a.teacher_data),
            "sampling_only": "algo.dynamic_sampling" if a.dynamic_sampling else f"--adv {a.adv}" if greedy else "",
            "behaviour_loss": a.policy_loss if loss is not None and loss.weighs_behaviour else "",
            "correction": a.rollout_correction,
            **(model_facts(spec) if spec is not None else {"model": cfg.model.name}),
        }
        return cls(**{**facts, **kw})


def model_facts(spec: ModelSpec) -> dict:
    """What the rules read of a model: its name, whether it takes images, its heads, layers and experts."""
    kv = None if spec.uses_mla else spec.num_kv_heads
    return dict(
        model=spec.name,
        vision=spec.is_vl,
        heads=spec.num_heads,
        kv_heads=kv,
        layers=spec.num_layers,
        experts=spec.num_experts,
    )


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
