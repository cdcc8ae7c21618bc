"""Which reward functions a run uses: ``reward.fn`` / ``reward.fns`` entries ``spec[:weight]``."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlctl.errors import UserError

__all__ = [
    "ENV_REWARDS",
    "SAMPLE_KEYWORDS",
    "TRL_KEYWORDS",
    "RewardSpec",
    "check_reward_config",
    "check_reward_signature",
    "needs_answer",
    "parse_spec",
    "reward_kind",
    "reward_specs",
    "rule_specs",
]


@dataclass(frozen=True)
class RewardSpec:
    """One weighted reward component: ``spec`` as :func:`~rlctl.rewards.loader.get_reward` takes it
    (or ``auto``: the built-in of each row's data_source), its ``weight`` and its metric ``name``."""

    spec: str
    weight: float = 1.0
    name: str = ""


def _weight(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value


def _short_name(spec: str) -> str:
    if ":" not in spec:
        return Path(spec).stem if spec.endswith(".py") else spec
    target, _, fn = spec.rpartition(":")
    return fn or Path(target).stem


def parse_spec(text: str) -> RewardSpec:
    """``gsm8k`` -> (gsm8k, 1.0); ``format:0.2`` -> (format, 0.2); ``my.py:score:0.5`` -> (my.py:score, 0.5).

    The part after the last ``:`` is a weight when it reads as a number, else part of the spec
    (``module:function``).
    """
    text = str(text).strip()
    spec, weight = text, 1.0
    if ":" in text:
        head, _, tail = text.rpartition(":")
        value = _weight(tail)
        if value is not None:
            spec, weight = head.strip(), value
    if not spec:
        raise UserError(f"reward {text!r} names no function; give NAME[:WEIGHT], e.g. --reward format:0.2")
    if not math.isfinite(weight):
        raise UserError(f"reward {text!r} has a non-finite weight; give a number, e.g. {spec}:0.5")
    return RewardSpec(spec, weight, _short_name(spec))


def reward_specs(fn: str = "auto", fns: list[str] | tuple[str, ...] = ()) -> list[RewardSpec]:
    """The weighted components of ``reward.fn`` (one spec, ``auto`` by default) or ``reward.fns`` (a
    list); unique metric names (a repeated name gets ``_2``, ``_3``...)."""
    fn = (fn or "auto").strip()
    if fns and fn != "auto":
        raise UserError(
            f"both reward.fn ({fn}) and reward.fns are set; list every reward in reward.fns (e.g. --reward {fn} "
            "--reward format:0.2)"
        )
    specs = [parse_spec(s) for s in fns] if fns else [parse_spec(fn)]
    seen: dict[str, int] = {}
    out = []
    for s in specs:
        seen[s.name] = seen.get(s.name, 0) + 1
        name = s.name if seen[s.name] == 1 else f"{s.name}_{seen[s.name]}"
        out.append(RewardSpec(s.spec, s.weight, name))
    return out


def rule_specs(reward_cfg: Any) -> list[RewardSpec]:
    """The rule components of a run's ``reward`` config: ``reward.fn`` / ``reward.fns``, or none when a
    reward model is given alone (``--reward-model`` without ``--reward``)."""
    if reward_cfg.model and not reward_cfg.fns and reward_cfg.fn == "auto":
        return []
    return reward_specs(reward_cfg.fn, list(reward_cfg.fns or []))


SAMPLE_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""What verl's reward managers pass a per-sample function, by keyword (so any parameter order works)."""
TRL_KEYWORDS = ("prompts", "completions", "completion_ids")
"""What TRL's GRPOTrainer passes every ``reward_funcs`` function, with each dataset column as a keyword."""
TRL_TRAINER_ONLY = ("trainer_state", "log_extra", "log_metric", "environments")
"""TRL keywords that only its trainer has; rlctl passes none of them."""


def reward_kind(obj: Any) -> str:
    """``class`` (a reward manager class), ``trl`` (TRL's ``reward_funcs`` form, taking ``completions``),
    ``batch`` (verl's batch form, taking ``solution_strs``) or ``sample`` (verl's
    ``fn(data_source=, solution_str=, ground_truth=, extra_info=)``)."""
    if inspect.isclass(obj):
        return "class"
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return "sample"
    if "completions" in params:
        return "trl"
    return "batch" if "solution_strs" in params or "data_sources" in params else "sample"


def check_reward_signature(fn: Any, spec: str) -> None:
    """A function the peer would call with keywords it cannot take (or that needs a keyword rlctl cannot
    give) is one line now, naming the fix, instead of a failure on every sample."""
    kind = reward_kind(fn)
    if kind == "class":
        return
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if kind == "trl":
        missing = [n for n in required if n in TRL_TRAINER_ONLY]
        if missing:
            raise UserError(
                f"reward {spec} requires {', '.join(missing)}, which only TRL's trainer passes; give "
                f"{missing[0]} a default (rlctl passes prompts, completions, completion_ids and the row's columns)"
            )
        return
    given = SAMPLE_KEYWORDS if kind == "sample" else ("data_sources", "solution_strs", "ground_truths", "extra_infos")
    unknown = [n for n in required if n not in given]
    missing = [] if takes_any else [n for n in given if n not in names]
    if unknown or missing:
        raise UserError(
            f"reward {spec} takes ({', '.join(required) or '...'}), but verl calls it by keyword "
            f"{', '.join(g + '=' for g in given)}: name its parameters so (or add **kwargs)"
        )


ENV_REWARDS = ("env", "tool", "interaction")
"""Reward names of an agent run's environment (``--reward env:0.5``), not functions."""
TRUTH_BUILTINS = ("gsm8k", "gsm8k_flexible", "math", "exact")
"""The built-ins that compare with each row's answer."""


def needs_answer(cfg: Any) -> bool:
    """Whether a run's rewards read each row's answer (``reward_model.ground_truth`` or ``data.answer_field``):
    ``auto`` (unless an environment or interaction scores the run, TRL's convention), a built-in that compares
    with it, or a verl-form function. A TRL reward function (the columns are its keywords), an environment's
    reward, ``format``, ``length`` or a reward model alone do not."""
    from rlctl.rewards.builtin import BUILTINS
    from rlctl.rewards.loader import get_reward

    env = bool(cfg.agent.env or cfg.agent.interaction)
    for s in rule_specs(cfg.reward):
        if s.spec == "auto":
            if not env:
                return True
        elif s.spec in BUILTINS:
            if s.spec in TRUTH_BUILTINS:
                return True
        elif s.spec not in ENV_REWARDS and reward_kind(get_reward(s.spec)) != "trl":
            return True
    return False


def check_reward_config(reward_cfg: Any) -> list[RewardSpec]:
    """Fail fast (before launching) on a bad ``reward`` config: every spec loads, the timeout and
    workers are sane, a local reward model directory exists. Returns the components. Loads no model."""
    from rlctl.rewards.loader import get_reward

    specs = reward_specs(reward_cfg.fn, list(reward_cfg.fns or []))
    for s in specs:
        if s.spec != "auto" and s.spec not in ENV_REWARDS:
            check_reward_signature(get_reward(s.spec), s.spec)  # an unknown name, a missing file: a UserError
    timeout = float(reward_cfg.timeout)
    if not math.isfinite(timeout) or timeout < 0:
        raise UserError(f"reward.timeout={timeout:g} must be >= 0 seconds (0: no limit), e.g. --set reward.timeout=30")
    if int(reward_cfg.workers) < -1:
        raise UserError(f"reward.workers={reward_cfg.workers} must be -1 (auto), 0 (serial) or a process count")
    model = str(reward_cfg.model or "")
    if model and not Path(model).exists() and (model.startswith((".", "/", "~")) or model.count("/") != 1):
        raise UserError(f"reward model {model} not found; give a local directory or a Hugging Face repo id org/name")
    return specs
