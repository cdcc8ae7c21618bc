"""When streaming (fully asynchronous) RL pays: the cost model of docs/async.md, and the plan's Decision.

Seconds per update of ``batch`` groups, 1 rollout + 1 trainer process against 2 synchronous ones:

- ``sync2 = R_dp + U_dp``: each data-parallel rank runs its half of the trajectories turn by turn (every
  turn waits for the slowest tool of the batch and the longest response), then the update halves, plus
  its all-reduce (both measured on the 2-process run: ``dp_rollout_s``, ``dp_update_s``);
- ``one-step-off = E[max(R_lock, U)] + S``: the rollout process runs the whole batch in lockstep while the
  trainer trains the previous one (``R_lock`` its rollout, ``U`` the update on one process, ``S`` the
  weight transfer); the pairing of independent draws is ignored here (docs/offpolicy.md keeps it);
- ``stream = max(G, U + S)``: with enough groups in flight (admission ``batch x (S+1)``) tool latency and
  the long tail hide behind other trajectories' generation, so the rollout process is busy generating,
  ``G`` seconds of decoding a batch's tokens in chunks (``stream_generate_s``: its ticks, re-prefills
  after each weight swap included), and the trainer needs ``U + S``; the slower sets the pace.

Streaming pays over one-step-off when ``R_lock`` (lockstep: tool waits and the longest turn) exceeds both
``G`` and ``U + S``: tool-heavy, long-tailed agent workloads. It does not when the update dominates
(``U >= R_lock``: both are trainer-bound) or when turns are short and tools instant (``R_lock ~ G``).
Torch-free: the planner and the benchmark (benchmarks/async_vs_sync.py) read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlctl.plan.types import Decision


@dataclass(frozen=True)
class StreamParts:
    lockstep_rollout_s: float  # R_lock: a batch's rollout, turns in lockstep, on one process
    stream_generate_s: float  # G: a batch's decoding in the streaming pool (busy time, no tool waits)
    update_s: float  # U: a batch's update on one process
    sync_s: float  # S: the weight transfer after an update
    dp_update_s: float  # the 2-process run's update (half the batch each, with the all-reduce)
    dp_rollout_s: float  # the 2-process run's lockstep rollout of half the batch


def predict_step_s(p: StreamParts) -> dict[str, float]:
    """Seconds per update of each schedule (module docstring)."""
    return {
        "sync2": p.dp_rollout_s + p.dp_update_s,
        "offpolicy": max(p.lockstep_rollout_s, p.update_s) + p.sync_s,
        "stream": max(p.stream_generate_s, p.update_s + p.sync_s),
    }


def streaming_decision(p: StreamParts, *, max_staleness: int) -> Decision:
    """``rollout.mode``: stream when it is predicted 10% faster than both others, with the staleness it needs."""
    s = predict_step_s(p)
    best_other = min(s["sync2"], s["offpolicy"])
    pays = s["stream"] * 1.1 < best_other
    bound = "trainer-bound" if p.update_s + p.sync_s >= p.stream_generate_s else "rollout-bound"
    why = (
        f"streaming predicted {s['stream']:.2f} s/update ({bound}) against synchronous {s['sync2']:.2f} and "
        f"one-step-off {s['offpolicy']:.2f}: "
        + (
            f"it pays (x{best_other / s['stream']:.2f}); --max-staleness {max(1, max_staleness)} keeps "
            f"{max(1, max_staleness) + 1} batches in flight to hide tool latency"
            if pays
            else "it does not pay (the update dominates, or lockstep turns cost little): keep rollout.mode=fixed"
        )
    )
    return Decision("rollout.mode", "stream" if pays else "fixed", why)
