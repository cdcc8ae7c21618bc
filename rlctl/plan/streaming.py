"""When streaming (fully asynchronous) RL pays: the cost model of docs/async.md, and the plan's Decision.

Seconds per update of ``batch`` groups, 1 rollout + 1 trainer process against 2 synchronous ones:

- ``sync2 = R_dp + U_dp``: each data-parallel rank runs its half of the trajectories turn by turn (every
  turn waits for the slowest tool of the batch and the longest response), then the update halves, plus
  its all-reduce (both measured on the 2-process run: ``dp_rollout_s``, ``dp_update_s``);
- ``one-step-off = E[max(R_lock, U)] + S``: the rollout process runs the whole batch in lockstep while the
  trainer trains the previous one (``R_lock`` its rollout, ``U`` the update on one process, ``S`` the
  weight transfer); the pairing of independent draws is ignored here (docs/offpolicy.md keeps it);
- ``stream = max(G, U + S, Lat / (S_max + 1))``: the slowest of three limits. The rollout process
  decodes a batch's tokens in chunks in ``G`` seconds (``stream_generate_s``: its busy time, re-prefills
  after each weight swap included); the trainer needs ``U + S``; and admission keeps at most
  ``batch x (S_max + 1)`` groups started but untrained, so by Little's law at most
  ``batch x (S_max + 1) / Lat`` groups finish a second when a group takes ``Lat`` seconds from its start to
  its last trajectory's end (``group_latency_s``: its turns, its tools' sleeps, its share of the engine).
  Tool latency hides behind other trajectories' generation only while the pool is deep enough: raising
  ``--max-staleness`` lifts the third limit until ``G`` or ``U + S`` binds.

Streaming pays over one-step-off when ``R_lock`` (lockstep: tool waits and the longest turn) exceeds both
``G`` and ``U + S``: tool-heavy, long-tailed agent workloads. It does not when the update dominates
(``U >= R_lock``: both are trainer-bound) or when turns are short and tools instant (``R_lock ~ G``).
Torch-free: the planner and the benchmark (benchmarks/async_vs_sync.py) read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rlctl.plan.types import Decision


@dataclass(frozen=True)
class StreamParts:
    lockstep_rollout_s: float  # R_lock: a batch's rollout, turns in lockstep, on one process
    stream_generate_s: float  # G: a batch's decoding in the streaming pool (busy time, no tool waits)
    update_s: float  # U: a batch's update on one process
    sync_s: float  # S: the weight transfer after an update
    dp_update_s: float  # the 2-process run's update (half the batch each, with the all-reduce)
    dp_rollout_s: float  # the 2-process run's lockstep rollout of half the batch
    group_latency_s: float  # Lat: a group's start to its last trajectory's end, in the streaming pool
    max_staleness: int  # S_max: admission's bound


def predict_step_s(p: StreamParts) -> dict[str, float]:
    """Seconds per update of each schedule (module docstring)."""
    return {
        "sync2": p.dp_rollout_s + p.dp_update_s,
        "offpolicy": max(p.lockstep_rollout_s, p.update_s) + p.sync_s,
        "stream": max(p.stream_generate_s, p.update_s + p.sync_s, p.group_latency_s / (p.max_staleness + 1)),
    }


def needed_staleness(p: StreamParts) -> int:
    """The least ``S_max`` whose latency limit ``Lat / (S_max + 1)`` is no slower than ``max(G, U + S)``."""
    other = max(p.stream_generate_s, p.update_s + p.sync_s)
    return max(0, math.ceil(p.group_latency_s / max(other, 1e-9)) - 1)


def streaming_decision(p: StreamParts) -> Decision:
    """``rollout.mode``: stream when it is predicted 10% faster than both others at the staleness asked, or
    else at the staleness its latency limit needs (:func:`needed_staleness`), which the reason names."""
    s = predict_step_s(p)
    best_other = min(s["sync2"], s["offpolicy"])
    at = p
    if s["stream"] * 1.1 >= best_other and needed_staleness(p) > p.max_staleness:
        at = replace(p, max_staleness=needed_staleness(p))  # the latency limit binds: more groups in flight
    stream = predict_step_s(at)["stream"]
    pays = stream * 1.1 < best_other
    limits = {
        "trainer-bound": at.update_s + at.sync_s,
        "rollout-bound": at.stream_generate_s,
        "latency-bound": at.group_latency_s / (at.max_staleness + 1),
    }
    bound = max(limits, key=limits.get)
    head = (
        f"streaming predicted {stream:.2f} s/update at --max-staleness {at.max_staleness} ({bound}) against "
        f"synchronous {s['sync2']:.2f} and one-step-off {s['offpolicy']:.2f}: "
    )
    if pays:
        return Decision("rollout.mode", {"mode": "stream", "max_staleness": at.max_staleness},
                        head + f"it pays (x{best_other / stream:.2f})")  # fmt: skip
    why = head + "it does not pay (the update dominates, or lockstep turns cost little): keep rollout.mode=fixed"
    return Decision("rollout.mode", {"mode": "fixed", "max_staleness": p.max_staleness}, why)
