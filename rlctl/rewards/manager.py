"""The one place that scores RL samples: :class:`RewardManager` routes each sample to its reward
functions (weighted components), counts failures and non-finite values, and :func:`reward_metrics`
turns the sums over every rank into the run's metrics (and stops the run when every sample failed).

The recipe's score step::

    result = manager.score(manager.batch(prompt_ids, response_ids, meta))   # this rank's samples
    sums = <sum result.sums over the ranks>                                  # a dict of floats
    metrics = reward_metrics(sums, result.errors)                            # UserError: all failed
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlctl.errors import UserError, one_line
from rlctl.rewards.builtin import BUILTINS
from rlctl.rewards.loader import default_for_data_source, get_reward
from rlctl.rewards.model import RewardModel
from rlctl.rewards.pool import RewardPool
from rlctl.rewards.spec import ENV_REWARDS, RewardSpec, reward_kind, rule_specs
from rlctl.rewards.worker import error_text

__all__ = [
    "RewardBatch",
    "RewardManager",
    "RewardResult",
    "DEFAULT_ENV_WEIGHTS",
    "classify",
    "env_weight",
    "reward_metrics",
    "trl_arguments",
    "reward_warning",
]

MAX_AUTO_WORKERS = 8


@dataclass
class RewardBatch:
    """What a class-based reward manager is called with (one entry per sample, aligned)."""

    prompts: list[str]  # decoded prompt text (special tokens kept: the chat template shows)
    responses: list[str]  # decoded response text (special tokens skipped), verl's solution_str
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    data_sources: list[str]
    ground_truths: list[Any]
    extra_infos: list[dict | None]
    trajectories: list = field(default_factory=list)  # agent runs: rlctl.agents Trajectory per sample
    rows: list[dict] = field(default_factory=list)  # each sample's dataset row (TRL reward functions' columns)

    @property
    def response_lengths(self) -> list[int]:
        return [len(r) for r in self.response_ids]

    def __len__(self) -> int:
        return len(self.responses)


@dataclass
class RewardResult:
    """This rank's scores (weighted sums, 0 where a component failed), the sums to add over ranks,
    and each component's first error (``"sample i: Type: message"``)."""

    scores: list[float]
    sums: dict[str, float]
    errors: dict[str, str] = field(default_factory=dict)
    parts: list[dict[str, float]] = field(default_factory=list)  # each sample's unweighted component values


# ---------------------------------------------------------------------------------------------
# One value


def classify(value: Any) -> tuple[str, float, dict[str, float], str | None]:
    """A reward result as ``(status, score, extra metrics, error)``; status ``ok``, ``failed`` (not a
    number nor a dict with a numeric ``"score"``) or ``nonfinite`` (nan or inf); score 0.0 unless ok."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            return "failed", 0.0, {}, f"KeyError: returned a dict without 'score' (keys: {', '.join(map(str, value))})"
        extras = {
            str(k): float(v)
            for k, v in value.items()
            if k != "score" and isinstance(v, numbers.Real) and math.isfinite(float(v))
        }
        value = value["score"]
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # a 0-d tensor or numpy scalar
        value = value.item()
    if not isinstance(value, numbers.Real):
        return (
            "failed",
            0.0,
            {},
            f"TypeError: returned {type(value).__name__}, expected a number or a dict with a 'score'",
        )
    score = float(value)
    if not math.isfinite(score):
        return "nonfinite", 0.0, extras, f"ValueError: returned a non-finite score {score}"
    return "ok", score, extras, None


# ---------------------------------------------------------------------------------------------
# Components


class _Component:
    def __init__(self, spec: RewardSpec):
        self.spec, self.name, self.weight = spec.spec, spec.name, spec.weight

    def outcomes(self, batch: RewardBatch, pool: RewardPool) -> list[tuple[bool, Any]]:
        raise NotImplementedError


def builtin_for(source: str) -> str:
    """The built-in reward for rows of ``data_source`` ``source``; a one-line UserError naming the fix."""
    name = default_for_data_source(source)
    if name is None:
        what = f"no built-in reward for data_source {source!r}" if source else "rows without a data_source"
        raise UserError(f"{what}: pass --reward with one of {', '.join(BUILTINS)}, or path/to/file.py:function")
    return name


class _Rule(_Component):
    """A verl reward function (``sample`` or ``batch`` form), or ``auto``: each row's built-in."""

    def __init__(self, spec: RewardSpec, data_sources: Iterable[str]):
        super().__init__(spec)
        self.route: dict[str, str] = {}
        if spec.spec == "auto":
            self.kind = "sample"
            for source in sorted(set(data_sources)):
                self._spec_of(source)  # an unroutable data_source fails now, before the model loads
        else:
            self.kind = reward_kind(get_reward(spec.spec))  # a wrong name fails now, before the model loads

    def _spec_of(self, source: str) -> str:
        """The built-in reward of ``source`` (``auto``), or this component's spec."""
        if self.spec != "auto":
            return self.spec
        if source not in self.route:
            self.route[source] = builtin_for(source)
        return self.route[source]

    def outcomes(self, batch: RewardBatch, pool: RewardPool) -> list[tuple[bool, Any]]:
        if self.kind == "trl":
            ((ok, result),) = pool.map([(self.spec, "trl", trl_arguments(batch))])
            if ok and isinstance(result, (list, tuple)):  # None: not applicable to that sample (TRL adds nothing)
                result = [0.0 if v is None else v for v in result]
            return _spread(ok, result, len(batch))
        if self.kind == "batch":
            args = {
                "data_sources": list(batch.data_sources),
                "solution_strs": list(batch.responses),
                "ground_truths": list(batch.ground_truths),
                "extra_infos": list(batch.extra_infos),
            }
            ((ok, result),) = pool.map([(self.spec, "batch", args)])
            return _spread(ok, result, len(batch))
        tasks = [
            (self._spec_of(ds), "sample", (ds, text, gt, info))
            for ds, text, gt, info in zip(batch.data_sources, batch.responses, batch.ground_truths, batch.extra_infos)
        ]
        return pool.map(tasks)


class _Class(_Component):
    """A reward manager class, constructed once (with the tokenizer) and called with the whole batch."""

    def __init__(self, spec: RewardSpec, tokenizer: Any):
        import inspect

        super().__init__(spec)
        cls = get_reward(spec.spec)
        try:
            params = inspect.signature(cls).parameters
        except (TypeError, ValueError):
            params = {}
        try:
            self.obj = cls(tokenizer=tokenizer) if "tokenizer" in params else cls()
        except Exception as exc:
            raise UserError(
                f"reward class {spec.spec} failed to construct: {type(exc).__name__}: {one_line(exc)}"
            ) from exc

    def outcomes(self, batch: RewardBatch, pool: RewardPool) -> list[tuple[bool, Any]]:
        try:
            result = self.obj(batch)
        except Exception as exc:
            return _spread(False, error_text(exc), len(batch))
        extra_info: dict = {}
        if isinstance(result, dict):
            extra_info = result.get("reward_extra_info") or {}
            result = next((result[k] for k in ("reward_tensor", "scores", "rewards") if k in result), result)
        if hasattr(result, "detach"):  # a tensor: [n], or verl's token-level [n, L] (summed per row)
            result = result.detach().float().cpu()
            result = (result.sum(-1) if result.dim() == 2 else result).tolist()
        out = _spread(True, result, len(batch))
        if extra_info and all(ok for ok, _ in out):
            out = [
                (True, {"score": v, **{k: vals[i] for k, vals in extra_info.items() if i < len(vals)}})
                for i, (_, v) in enumerate(out)
            ]
        return out


class _Model(_Component):
    """A reward model (``reward.model``): logit 0 of a sequence classifier on prompt + response."""

    def __init__(self, spec: RewardSpec, rm: RewardModel):
        super().__init__(spec)
        self.rm = rm

    def outcomes(self, batch: RewardBatch, pool: RewardPool) -> list[tuple[bool, Any]]:
        try:
            return [(True, v) for v in self.rm.score(batch.prompts, batch.responses)]
        except Exception as exc:
            return _spread(False, error_text(exc), len(batch))


class _EnvReward(_Component):
    """One named reward of the trajectories' environments (0 where a trajectory has none)."""

    def outcomes(self, batch: RewardBatch, pool: RewardPool) -> list[tuple[bool, Any]]:
        return [(True, t.rewards.get(self.name, 0.0)) for t in batch.trajectories]


def _num_turns(messages: list[dict]) -> int:
    """verl's ``__num_turns__``: the prompt, each assistant turn and each round of tool / user replies."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    after = [m.get("role") for m in messages[first:]]
    rounds = sum(r != "assistant" and (i == 0 or after[i - 1] == "assistant") for i, r in enumerate(after))
    return 1 + after.count("assistant") + rounds


def _completion(prompt: Any, response: str, trajectory: Any) -> Any:
    """A sample's completion as TRL gives it: the messages after the prompt for a chat prompt (a multi-turn
    trajectory's assistant and tool turns), the text for a plain one."""
    if not isinstance(prompt, list):
        return response
    if trajectory is None:
        return [{"role": "assistant", "content": response}]
    messages = trajectory.messages
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return [dict(m) for m in messages[first:]]


def trl_arguments(batch: RewardBatch) -> dict[str, list]:
    """TRL's ``reward_funcs`` keywords: ``prompts``, ``completions``, ``completion_ids`` and every other column
    of the rows (a column a row lacks is None there), one entry per sample."""
    rows = batch.rows or [{} for _ in range(len(batch))]
    prompts = [r.get("prompt", p) for r, p in zip(rows, batch.prompts)]
    trajs = batch.trajectories or [None] * len(batch)
    out: dict[str, list] = {
        "prompts": prompts,
        "completions": [_completion(p, r, t) for p, r, t in zip(prompts, batch.responses, trajs)],
        "completion_ids": [list(r) for r in batch.response_ids],
    }
    columns = dict.fromkeys(k for r in rows for k in r if k not in ("prompt", "completion", "completion_ids"))
    out.update({k: [r.get(k) for r in rows] for k in columns})
    return out


DEFAULT_ENV_WEIGHTS = {"env": 1.0}
"""TRL adds an environment's ``get_reward`` to the score with weight 1; verl's tool agent loop adds nothing of
tool step rewards (``tool``), ``calc_reward`` (named by tool) or interaction turn scores (``interaction``): they
are reported with weight 0 unless ``--reward tool:W`` / ``interaction:W`` weights them."""


def env_weight(name: str, given: dict[str, float]) -> float:
    """The weight of an environment's reward ``name``: ``given`` (from reward.fns) or the peer's default; a verl
    tool's calc_reward (named by its tool) goes with ``tool``."""
    key = name if name in ENV_REWARDS else "tool"
    return given.get(key, DEFAULT_ENV_WEIGHTS.get(key, 0.0))


def _spread(ok: bool, result: Any, n: int) -> list[tuple[bool, Any]]:
    """A batch call's outcome per sample: its list of results, or its error for every sample."""
    if not ok:
        return [(False, result)] * n
    if not isinstance(result, (list, tuple)) or len(result) != n:
        what = f"{len(result)} values" if isinstance(result, (list, tuple)) else type(result).__name__
        return [(False, f"ValueError: a batch reward returned {what} for {n} samples")] * n
    return [(True, v) for v in result]


# ---------------------------------------------------------------------------------------------
# The manager


def _auto_workers(local_world: int) -> int:
    return max(1, min(MAX_AUTO_WORKERS, (os.cpu_count() or 1) // max(1, local_world)))


class RewardManager:
    """Built once per run from the ``reward`` config (and the tokenizer, for class rewards).

    Components: ``reward.fns`` (``spec[:weight]`` each) or ``reward.fn`` (``auto``: each row's
    built-in by data_source), plus ``reward.model`` (weight ``reward.model_weight``). Rule rewards
    run in ``reward.workers`` processes (-1: auto, 0: serial in this process), each call limited to
    ``reward.timeout`` seconds. A sample's score is the weighted sum of its components.
    """

    def __init__(
        self,
        reward_cfg: Any,
        data_sources: Iterable[str] = (),
        *,
        tokenizer: Any = None,
        device: str = "cpu",
        local_world: int = 1,
        agent: bool = False,
    ):
        r = reward_cfg
        self.tokenizer = tokenizer
        specs = rule_specs(r)
        sources = list(data_sources)
        # the environment's own rewards (weighted by --reward env:W, tool:W, interaction:W)
        self.env_weights = {s.spec: s.weight for s in specs if s.spec in ENV_REWARDS}
        specs = [s for s in specs if s.spec not in ENV_REWARDS]
        if agent and [s.spec for s in specs] == ["auto"] and any(default_for_data_source(x) is None for x in sources):
            specs = []  # an agent run without a built-in for its rows: its environment's rewards score it
        self.components: list[_Component] = []
        for s in specs:
            obj_kind = "rule" if s.spec == "auto" else reward_kind(get_reward(s.spec))
            self.components.append(_Class(s, tokenizer) if obj_kind == "class" else _Rule(s, sources))
        if r.model:
            rm = RewardModel(r.model, dtype=r.model_dtype, micro_batch=r.model_micro_batch, device=device)
            self.components.append(_Model(RewardSpec(r.model, float(r.model_weight), "rm"), rm))
        workers = int(r.workers)
        self.pool = RewardPool(_auto_workers(local_world) if workers < 0 else workers, float(r.timeout))

    @classmethod
    def for_run(cls, cfg: Any, data: Any, tokenizer: Any, *, device: str = "cpu", local_world: int = 1):
        """The manager of a run: ``cfg.reward`` and the data sources of ``data.train + data.val``."""
        from rlctl.config import agent_enabled

        sources = {p.data_source for p in list(data.train) + list(data.val)}
        return cls(
            cfg.reward, sources, tokenizer=tokenizer, device=device, local_world=local_world, agent=agent_enabled(cfg)
        )

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.components]

    def batch(
        self,
        prompt_ids: Sequence[Sequence[int]],
        response_ids: Sequence[Sequence[int]],
        meta: Sequence[Any],
        trajectories: Sequence[Any] | None = None,
    ):
        """A :class:`RewardBatch` from token ids and each sample's :class:`~rlctl.data.rl.Prompt`. With
        multi-turn ``trajectories`` the response text is the whole response (tool turns included) and each
        ``extra_info`` also holds ``messages``, ``tool_calls`` and ``turns``."""
        tok = self.tokenizer
        extra = [m.extra_info for m in meta]
        if trajectories:  # num_turns and rollout_reward_scores: what verl's naive reward manager adds
            extra = [
                {
                    **(e or {}),
                    "messages": t.messages,
                    "tool_calls": t.tool_call_list(),
                    "turns": t.turns,
                    "num_turns": _num_turns(t.messages),
                    "rollout_reward_scores": dict(t.rewards),
                }
                for e, t in zip(extra, trajectories)
            ]
        return RewardBatch(
            prompts=tok.batch_decode([list(p) for p in prompt_ids]) if tok is not None else [""] * len(meta),
            responses=tok.batch_decode([list(r) for r in response_ids], skip_special_tokens=True)
            if tok is not None
            else [""] * len(meta),
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=[list(r) for r in response_ids],
            data_sources=[m.data_source for m in meta],
            ground_truths=[m.ground_truth for m in meta],
            extra_infos=extra,
            trajectories=list(trajectories or []),
            rows=[dict(getattr(m, "row", None) or {}) for m in meta],
        )

    def score(self, batch: RewardBatch) -> RewardResult:
        """This rank's samples: weighted scores, the sums for :func:`reward_metrics`, first errors."""
        n = len(batch)
        scores = [0.0] * n
        failed, nonfinite = [False] * n, [False] * n
        sums: dict[str, float] = {}
        errors: dict[str, str] = {}
        extras: dict[str, list[float]] = {}
        parts: list[dict[str, float]] = [{} for _ in range(n)]
        for comp in self.components + self._env_components(batch):
            comp_sum, bad = 0.0, 0
            for i, (ok, value) in enumerate(comp.outcomes(batch, self.pool)):
                status, score, more, err = classify(value) if ok else ("failed", 0.0, {}, value)
                if status != "ok":
                    bad += 1
                    errors.setdefault(comp.name, f"sample {i}: {one_line(err)}")
                    (failed if status == "failed" else nonfinite)[i] = True
                scores[i] += comp.weight * score
                parts[i][comp.name] = score
                comp_sum += score
                for k, v in more.items():
                    extras.setdefault(k, []).append(v)
            sums[f"comp/{comp.name}/sum"] = comp_sum
            sums[f"comp/{comp.name}/bad"] = float(bad)
        for k, vals in extras.items():
            sums[f"extra/{k}/sum"], sums[f"extra/{k}/n"] = float(sum(vals)), float(len(vals))
        nonfinite = [nf and not f for nf, f in zip(nonfinite, failed)]
        sums.update(
            n=float(n),
            sum=float(sum(scores)),
            sq=float(sum(s * s for s in scores)),
            nonbinary=float(sum(s not in (0.0, 1.0) for s in scores)),
            failed=float(sum(failed)),
            nonfinite=float(sum(nonfinite)),
        )
        return RewardResult(scores, sums, errors, parts)

    def _env_components(self, batch: RewardBatch) -> list[_Component]:
        """An environment's named rewards as components (reported in samples.jsonl and the metrics). Each peer's
        weights by default (:func:`env_weight`) unless reward.fns names one (``env:0.5``, ``tool:1``)."""
        names = sorted({k for t in batch.trajectories for k in t.rewards})
        return [_EnvReward(RewardSpec(k, env_weight(k, self.env_weights), k)) for k in names]

    def close(self) -> None:
        self.pool.close()


def reward_metrics(sums: dict[str, float], errors: dict[str, str] | None = None) -> dict[str, float]:
    """The reward metrics of a step from the sums of :attr:`RewardResult.sums` over every rank.

    ``reward/mean``, ``reward/std``, ``reward/failed`` (samples where a component raised, timed out
    or returned a non-number), ``reward/nonfinite`` (nan or inf), ``reward/errors`` (both),
    ``reward/<component>`` (its unweighted mean, when there are several), ``reward/<key>`` (the
    mean of each extra numeric key of dict results) and ``acc`` (when every score is 0 or 1).

    Raises the one-line :class:`UserError` when a component failed on every sample (``errors``:
    this rank's first error of each component, for the message).
    """
    errors = errors or {}
    n = sums.get("n", 0.0)
    comps = [k[len("comp/") : -len("/sum")] for k in sorted(sums) if k.startswith("comp/") and k.endswith("/sum")]
    for name in comps:
        if n and sums.get(f"comp/{name}/bad", 0.0) >= n:
            first = errors.get(name) or "see the other ranks' logs"
            raise UserError(f"reward function {name} failed on every sample: {one_line(first)}")
    denom = max(1.0, n)
    mean = sums.get("sum", 0.0) / denom
    out = {
        "reward/mean": mean,
        "reward/std": math.sqrt(max(0.0, sums.get("sq", 0.0) / denom - mean * mean)),
        "reward/failed": sums.get("failed", 0.0),
        "reward/nonfinite": sums.get("nonfinite", 0.0),
        "reward/errors": sums.get("failed", 0.0) + sums.get("nonfinite", 0.0),
    }
    if sums.get("nonbinary", 0.0) == 0:
        out["acc"] = mean
    if len(comps) > 1:
        for name in comps:
            out[f"reward/{name}"] = sums[f"comp/{name}/sum"] / denom
    for k in sorted(sums):
        if k.startswith("extra/") and k.endswith("/sum"):
            key = k[len("extra/") : -len("/sum")]
            out.setdefault(f"reward/{key}", sums[k] / max(1.0, sums.get(f"extra/{key}/n", 0.0)))
    return out


def reward_warning(sums: dict[str, float], errors: dict[str, str], step: int) -> str | None:
    """The console warning of a step where some samples failed or were non-finite (from the summed
    :attr:`RewardResult.sums`), else None."""
    failed, nonfinite = int(sums.get("failed", 0)), int(sums.get("nonfinite", 0))
    if not failed + nonfinite:
        return None
    first = next(iter(errors.values()), None)
    tail = f"; first: {one_line(first)}" if first else ""
    return (
        f"warning: step {step + 1}: the reward function failed on {failed + nonfinite} of {int(sums.get('n', 0))} "
        f"samples (scored 0; {failed} failed, {nonfinite} non-finite){tail}"
    )
