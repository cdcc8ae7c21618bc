"""When streaming (fully asynchronous) RL pays: the cost model of docs/async.md, and the plan's Decision.

Seconds per update of ``batch`` groups, 1 rollout + 1 trainer process against 2 synchronous ones:

- ``sync2 = R_dp + U_dp``: each data-parallel rank runs its half of the trajectories turn by turn (every
  turn waits for the slowest tool of the batch and the longest response), then the update halves, plus
  its all-reduce (both measured on the 2-process run: ``dp_rollout_s``, ``dp_update_s``);
- ``one-step-off = E[max(R_lock, U)] + S``: the rollout process runs the whole batch in lockstep while the
  trainer trains the previous one (``R_lock`` its rollout, ``U`` the update on one process, ``S`` the
  weight transfer); the pairing of independent draws is ignored here (docs/offpolicy.md keeps it);
- ``stream = max(G, U + S, A)``: the slowest of three limits. The rollout process decodes a batch's
  tokens in ``G`` seconds (``stream_generate_s``: its busy time per batch started); the trainer needs
  ``U + S``; and ``A`` is the admission schedule's mean seconds per update (:func:`admission_interval_s`):
  a group starts when an update frees admission capacity (``batch x (S_max + 1)`` started but untrained),
  it completes ``Lat`` seconds later (a draw from ``group_latencies``: start to its last trajectory's
  end, turns, tool sleeps, its share of the engine), and update ``v`` starts when update ``v - 1`` is
  done and the groups :class:`rlctl.algos.admission.Admission` names for it have completed, the oldest
  first, the trainer waiting for an old slow group when its deadline comes. With the pool full, batch
  ``v`` is the ``batch`` groups started when update ``v - S_max - 1`` ended, so ``S_max + 1`` updates take
  at least ``U + S + E[max of a batch's Lat]``: ``A ~ (U + S + E[max Lat]) / (S_max + 1)``; the schedule
  is simulated (the real Admission, latencies drawn with a fixed seed) because slow groups synchronise
  the starts into bursts and the mean interval exceeds that bound. (The model before this one took
  ``Lat_mean / (S_max + 1)``, Little's law over the mean group: it missed the batch's slowest group and
  the update inside the cycle, and predicted 0.35 s/update where an idle run took 0.72: docs/async.md.)

Nothing here is fitted to a measured ratio: every input is a part measured in the runs (or, for a
planned job, given: :func:`workload_latencies` builds ``group_latencies`` from calls per trajectory,
tool latency and decode seconds per turn).

Streaming pays over one-step-off when ``R_lock`` (lockstep: tool waits and the longest turn) exceeds
``G``, ``U + S`` and ``A``: tool-heavy, long-tailed agent workloads. It does not when the update dominates
(``U >= R_lock``: both are trainer-bound) or when turns are short and tools instant (``R_lock ~ G``).
Torch-free: the planner and the benchmark (benchmarks/async_vs_sync.py) read it.
"""

from __future__ import annotations

import heapq
import random
import statistics
from dataclasses import dataclass, replace

from rlctl.algos.admission import Admission
from rlctl.plan.types import Decision

SIM_UPDATES, SIM_WARMUP = 1500, 20  # the simulated schedule: updates, and the first ones not counted


@dataclass(frozen=True)
class StreamParts:
    lockstep_rollout_s: float  # R_lock: a batch's rollout, turns in lockstep, on one process
    stream_generate_s: float  # G: a batch's decoding in the streaming pool (busy time, no tool waits)
    update_s: float  # U: a batch's update on one process
    sync_s: float  # S: the weight transfer after an update
    dp_update_s: float  # the 2-process run's update (half the batch each, with the all-reduce)
    dp_rollout_s: float  # the 2-process run's lockstep rollout of half the batch
    group_latencies: tuple[float, ...]  # Lat: a sample of a group's start to its last trajectory's end
    max_staleness: int  # S_max: admission's bound
    batch: int = 4  # groups per update


def admission_interval_s(p: StreamParts, *, updates: int = SIM_UPDATES, seed: int = 0) -> float:
    """``A``: the mean seconds per update of the admission schedule when only group latency and the
    trainer (``U + S``) take time (module docstring). Deterministic for a seed."""
    rng, adm, pending = random.Random(seed), Admission(p.batch, p.max_staleness), []
    step = p.update_s + p.sync_s

    def start(now: float) -> None:
        while adm.can_start():
            heapq.heappush(pending, (now + rng.choice(p.group_latencies), adm.start()))

    start(0.0)
    now = end = 0.0
    ends, batch = [], None
    for _ in range(updates):
        if batch is not None:  # the weights of the last update arrive: its groups leave, new ones start
            adm.train(batch)
            start(end)
        now = max(now, end)
        while pending and pending[0][0] <= now:
            adm.complete(heapq.heappop(pending)[1])
        while (batch := adm.next_batch()) is None:  # wait for the next completion
            done, index = heapq.heappop(pending)
            now = max(now, done)
            adm.complete(index)
        end = max(now, end) + step
        ends.append(end)
    return (ends[-1] - ends[SIM_WARMUP - 1]) / (updates - SIM_WARMUP)


def stream_limits(p: StreamParts) -> dict[str, float]:
    """The three limits of a streaming update, by name."""
    return {
        "rollout-bound": p.stream_generate_s,
        "trainer-bound": p.update_s + p.sync_s,
        "latency-bound": admission_interval_s(p),
    }


def predict_step_s(p: StreamParts) -> dict[str, float]:
    """Seconds per update of each schedule (module docstring)."""
    return {
        "sync2": p.dp_rollout_s + p.dp_update_s,
        "offpolicy": max(p.lockstep_rollout_s, p.update_s) + p.sync_s,
        "stream": max(stream_limits(p).values()),
    }


def needed_staleness(p: StreamParts, *, most: int = 16) -> int:
    """The least ``S_max`` whose admission interval ``A`` is within 5% of ``max(G, U + S)`` (more groups
    in flight buy nothing beyond it), at most ``most``."""
    other = max(p.stream_generate_s, p.update_s + p.sync_s)
    for s in range(most + 1):
        if admission_interval_s(replace(p, max_staleness=s)) <= other * 1.05:
            return s
    return most


def workload_latencies(
    n: int, calls_pmf: list[float], tool_s: float, turn_s: float, *, draws: int = 2000, seed: int = 0
) -> tuple[float, ...]:
    """A sample of group latencies for a planned workload: each of a group's ``n`` trajectories makes
    ``c`` tool calls (``calls_pmf[c]``), each sleeping an exponential ``tool_s`` on average, and decodes
    ``c + 1`` turns of ``turn_s`` seconds each (decoding at the pool's concurrency); the group ends with
    its slowest trajectory."""
    rng = random.Random(seed)
    out = []
    for _ in range(draws):
        calls = rng.choices(range(len(calls_pmf)), calls_pmf, k=n)
        out.append(max((c + 1) * turn_s + sum(rng.expovariate(1 / tool_s) for _ in range(c)) for c in calls))
    return tuple(out)


def turn_s_for(mean_latency_s: float, n: int, calls_pmf: list[float], tool_s: float) -> float:
    """The decode seconds per turn at which :func:`workload_latencies` has the measured mean group latency
    (for a run that recorded the mean only: the decoding's share of a group's latency)."""
    lo, hi = 0.0, mean_latency_s
    for _ in range(30):
        mid = (lo + hi) / 2
        below = statistics.fmean(workload_latencies(n, calls_pmf, tool_s, mid)) < mean_latency_s
        lo, hi = (mid, hi) if below else (lo, mid)
    return (lo + hi) / 2


def streaming_decision(p: StreamParts) -> Decision:
    """``rollout.mode``: stream when it is predicted 10% faster than both others at the staleness asked, or
    else at the staleness its latency limit needs (:func:`needed_staleness`), which the reason names."""
    s = predict_step_s(p)
    best_other = min(s["sync2"], s["offpolicy"])
    at = p
    if s["stream"] * 1.1 >= best_other and needed_staleness(p) > p.max_staleness:
        at = replace(p, max_staleness=needed_staleness(p))  # the latency limit binds: more groups in flight
    limits = stream_limits(at)
    stream = max(limits.values())
    pays = stream * 1.1 < best_other
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
