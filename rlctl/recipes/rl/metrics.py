"""A step's metrics: the dict every RL step returns, the seconds of a phase (:func:`timed`), and one
step's record from the parts its steps returned (:func:`merged`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

Metrics = dict[str, float]


@contextmanager
def timed(metrics: Metrics, key: str) -> Iterator[None]:
    """Adds the block's seconds to ``metrics[key]``; a named range in a profile (RLCTL_PROFILE)."""
    start = time.perf_counter()
    try:
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function(key):
                yield
        else:
            yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - start


def merged(*parts: Metrics) -> Metrics:
    """One step's metrics from those its steps returned: the seconds of a phase several steps time
    (``time/logprobs``, ``time/update``) add up; every other key comes from one step."""
    out: Metrics = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out[key] + value if key in out and key.startswith("time/") else value
    return out
