"""Scoring a batch of responses with one reward function, tolerating per-sample failures."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from rlctl.errors import UserError
from rlctl.rewards.loader import RewardFn

__all__ = ["score_batch"]


def _as_score(value: Any) -> float:
    if isinstance(value, numbers.Real):  # bool and int included
        score = float(value)
        if not math.isfinite(score):
            raise ValueError(f"returned a non-finite score {score}")
        return score
    raise TypeError(f"returned {type(value).__name__}, expected a number or a dict with a 'score'")


def _parse(result: Any) -> tuple[float, dict[str, float]]:
    """A reward result as (score, other numeric metrics)."""
    if not isinstance(result, dict):
        return _as_score(result), {}
    if "score" not in result:
        raise KeyError(f"returned a dict without 'score' (keys: {', '.join(map(str, result))})")
    metrics = {str(k): float(v) for k, v in result.items() if k != "score" and isinstance(v, numbers.Real)}
    return _as_score(result["score"]), metrics


def _name(fn: RewardFn) -> str:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else repr(fn)


def score_batch(
    fn: RewardFn,
    data_sources: Sequence[str],
    solutions: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
) -> tuple[list[float], dict[str, list[float | None]], int, str | None]:
    """Score each sample with ``fn(data_source, solution, ground_truth, extra_info)``.

    Returns ``(scores, extras, n_errors, first_error)``:

    - ``scores``: one float per sample. A result may be a number (bool and int are cast) or a
      dict with a ``"score"``; a sample whose call raises or returns anything else (a string, a
      dict without ``"score"``, nan) scores 0.0 and counts as an error.
    - ``extras``: for each other numeric key of the dict results, a list aligned with the samples
      (None where a sample did not return it), for metrics.
    - ``n_errors`` and ``first_error`` (``"sample i: Type: message"``, or None).

    Raises :class:`UserError` when the function fails on every sample of a non-empty batch.
    """
    n = len(solutions)
    extra_infos = [None] * n if extra_infos is None else extra_infos
    if not len(data_sources) == len(ground_truths) == len(extra_infos) == n:
        raise ValueError(
            f"score_batch got {len(data_sources)} data sources, {n} solutions, "
            f"{len(ground_truths)} ground truths and {len(extra_infos)} extra infos"
        )
    scores: list[float] = []
    per_sample: list[dict[str, float]] = []
    n_errors, first_error = 0, None
    for i, args in enumerate(zip(data_sources, solutions, ground_truths, extra_infos)):
        try:
            score, metrics = _parse(fn(*args))
        except Exception as exc:
            n_errors += 1
            first_error = first_error or f"sample {i}: {type(exc).__name__}: {exc}"
            score, metrics = 0.0, {}
        scores.append(score)
        per_sample.append(metrics)
    if n and n_errors == n:
        raise UserError(f"reward function {_name(fn)} failed on every sample: {first_error}")
    keys = dict.fromkeys(k for metrics in per_sample for k in metrics)
    extras = {k: [metrics.get(k) for metrics in per_sample] for k in keys}
    return scores, extras, n_errors, first_error
