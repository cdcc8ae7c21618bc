"""Scoring a batch of responses with one per-sample reward function, in this process.

It never raises for failed samples: deciding that every sample failed is :func:`rlctl.rewards.reward_metrics`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlctl.errors import one_line
from rlctl.rewards.loader import RewardFn
from rlctl.rewards.manager import classify
from rlctl.rewards.spec import SAMPLE_KEYWORDS

__all__ = ["score_batch"]


def score_batch(
    fn: RewardFn,
    data_sources: Sequence[str],
    solutions: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[dict | None] | None = None,
) -> tuple[list[float], dict[str, list[float | None]], int, str | None]:
    """Score each sample with ``fn(data_source=, solution_str=, ground_truth=, extra_info=)`` (by keyword, as verl).

    Returns ``(scores, extras, n_errors, first_error)``:

    - ``scores``: one float per sample. A result may be a number (bool and int are cast) or a
      dict with a ``"score"``; a sample whose call raises or returns anything else (a string, a
      dict without ``"score"``, nan) scores 0.0 and counts as an error.
    - ``extras``: for each other numeric key of the dict results, a list aligned with the samples
      (None where a sample did not return it), for metrics.
    - ``n_errors`` and ``first_error`` (``"sample i: Type: message"``, or None).
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
            status, score, metrics, err = classify(fn(**dict(zip(SAMPLE_KEYWORDS, args))))
        except Exception as exc:
            status, score, metrics, err = "failed", 0.0, {}, f"{type(exc).__name__}: {exc}"
        if status != "ok":
            n_errors += 1
            first_error = first_error or f"sample {i}: {one_line(err)}"
            metrics = {}
        scores.append(score)
        per_sample.append(metrics)
    keys = dict.fromkeys(k for metrics in per_sample for k in metrics)
    extras = {k: [metrics.get(k) for metrics in per_sample] for k in keys}
    return scores, extras, n_errors, first_error
