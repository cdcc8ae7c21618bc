"""rlctl.plan.streaming: the three limits of a streaming step and the rollout.mode Decision, by hand."""

from __future__ import annotations

from rlctl.plan.streaming import StreamParts, needed_staleness, predict_step_s, streaming_decision


def parts(**kw) -> StreamParts:
    base = dict(
        lockstep_rollout_s=3.0,  # tool waits in lockstep
        stream_generate_s=1.0,
        update_s=0.6,
        sync_s=0.01,
        dp_update_s=0.4,
        dp_rollout_s=2.0,
        group_latency_s=2.0,
        max_staleness=2,
    )
    return StreamParts(**(base | kw))


def test_each_limit_by_hand():
    p = parts()
    s = predict_step_s(p)
    assert s == {"sync2": 2.4, "offpolicy": 3.01, "stream": 1.0}  # max(1.0, 0.61, 2.0 / 3)
    assert predict_step_s(parts(max_staleness=0))["stream"] == 2.0  # latency-bound: Lat / 1
    assert predict_step_s(parts(update_s=5.0))["stream"] == 5.01  # trainer-bound


def test_decision_says_when_and_what_staleness():
    d = streaming_decision(parts())
    assert d.key == "rollout.mode" and d.value == {"mode": "stream", "max_staleness": 2} and "x2.40" in d.why
    assert needed_staleness(parts()) == 1  # Lat / (S + 1) <= max(G, U + S) = 1.0 from S = 1
    slow_update = streaming_decision(parts(update_s=5.0, dp_update_s=2.6))
    assert slow_update.value["mode"] == "fixed" and "does not pay" in slow_update.why
    # at S = 0 a group's 2.2 s latency binds (2.2 s vs sync2's 2.4: not 10% faster); S = 2 brings it to 0.73
    latency = streaming_decision(parts(max_staleness=0, group_latency_s=2.2))
    assert latency.value == {"mode": "stream", "max_staleness": 2} and "rollout-bound" in latency.why
