"""rlctl.plan.streaming: the limits of a streaming update and the rollout.mode Decision, worked by hand."""

from __future__ import annotations

import statistics

import pytest

from rlctl.plan.streaming import (
    StreamParts,
    admission_interval_s,
    needed_staleness,
    predict_step_s,
    streaming_decision,
    turn_s_for,
    workload_latencies,
)


def parts(**kw) -> StreamParts:
    base = dict(
        lockstep_rollout_s=3.0,  # tool waits in lockstep
        stream_generate_s=1.0,
        update_s=0.6,
        sync_s=0.01,
        dp_update_s=0.4,
        dp_rollout_s=2.0,
        group_latencies=(2.0,),
        max_staleness=2,
        batch=4,
    )
    return StreamParts(**(base | kw))


def test_admission_interval_by_hand_constant_latency():
    # batch 2, S = 1, every group 1.0 s, update 0.2 s. t = 0: 4 groups start (cap 2 x 2), all done at 1.0;
    # update 0 runs 1.0-1.2, update 1 1.2-1.4 (the other two); the 2 groups started at 1.2 are batch 2,
    # done at 2.2, trained 2.2-2.4; those started at 1.4 are done at 2.4, trained 2.4-2.6; ... so every
    # S + 1 = 2 updates take L + U = 1.2 s: 0.6 s per update (Little's law over the mean gave L / 2 = 0.5).
    p = parts(update_s=0.2, sync_s=0.0, group_latencies=(1.0,), max_staleness=1, batch=2)
    assert admission_interval_s(p) == pytest.approx(0.6, abs=1e-9)
    assert admission_interval_s(parts(update_s=0.2, sync_s=0.0, group_latencies=(1.0,), max_staleness=2)) == (
        pytest.approx(1.2 / 3, abs=1e-3)  # (L + U) / (S + 1)
    )
    # the update dominates: every batch is done before the trainer is free
    assert admission_interval_s(parts(update_s=0.5, sync_s=0.0, group_latencies=(0.1,))) == pytest.approx(0.5)


def test_admission_interval_waits_for_the_batch_slowest_group():
    # S = 0 is synchronous: batch 2 starts when the update ends and waits for the slower of its 2 groups.
    # Latency 0.5 or 1.5 s, each with probability 1/2: E[max of 2] = 0.5 / 4 + 1.5 x 3 / 4 = 1.25.
    p = parts(update_s=0.1, sync_s=0.0, group_latencies=(0.5, 1.5), max_staleness=0, batch=2)
    assert admission_interval_s(p) == pytest.approx(0.1 + 1.25, rel=0.03)
    assert admission_interval_s(p) == admission_interval_s(p)  # fixed seed: deterministic


def test_each_limit_by_hand():
    s = predict_step_s(parts())
    # sync2 2.0 + 0.4; one-step-off max(3.0, 0.6) + 0.01; stream max(G 1.0, U + S 0.61, A (2.61) / 3 = 0.87)
    assert s["sync2"] == 2.4 and s["offpolicy"] == 3.01 and s["stream"] == 1.0
    assert predict_step_s(parts(max_staleness=0))["stream"] == pytest.approx(2.61)  # latency-bound: L + U + S
    assert predict_step_s(parts(update_s=5.0))["stream"] == pytest.approx(5.01)  # trainer-bound


def test_workload_latencies_and_turn_seconds():
    assert set(workload_latencies(4, [1.0], 0.25, 0.3, draws=50)) == {0.3}  # no tool calls: one turn each
    pmf = [0.4, 0.24, 0.144, 0.0864, 0.1296]
    turn = turn_s_for(1.0, 4, pmf, 0.25)
    assert statistics.fmean(workload_latencies(4, pmf, 0.25, turn)) == pytest.approx(1.0, rel=1e-6)
    # one call each, no decode time: a group is the slowest of 4 exponential sleeps, E = 0.25 x H_4
    lat = workload_latencies(4, [0.0, 1.0], 0.25, 0.0, draws=20000)
    assert statistics.fmean(lat) == pytest.approx(0.25 * (1 + 1 / 2 + 1 / 3 + 1 / 4), rel=0.03)


def test_decision_says_when_and_what_staleness():
    d = streaming_decision(parts())
    assert d.key == "rollout.mode" and d.value == {"mode": "stream", "max_staleness": 2} and "x2.40" in d.why
    assert "rollout-bound" in d.why
    # A(S) = 2.61 / (S + 1) falls within 5% of max(G, U + S) = 1.0 from S = 2 (0.87; S = 1 gives 1.31)
    assert needed_staleness(parts()) == 2
    slow_update = streaming_decision(parts(update_s=5.0, dp_update_s=2.6))
    assert slow_update.value["mode"] == "fixed" and "does not pay" in slow_update.why
    # at S = 0 a group's 2.0 s latency and the update bind (2.61 s against sync2's 2.4): the plan raises S
    latency = streaming_decision(parts(max_staleness=0))
    assert latency.value == {"mode": "stream", "max_staleness": 2} and "rollout-bound" in latency.why
