"""rlctl.algos.admission: a property test over random completion times (seeded, many draws).

An event simulation independent of the class's own bookkeeping: a rollout side that starts groups while
admission lets it (up to a concurrency limit), each running for a random long-tailed time, and a trainer
that takes :meth:`Admission.next_batch` whenever it is not None and spends a random time per update. The
simulation records each group's start version and the update that trained it itself; the properties: no
group is trained more than S updates after it started, every started group is trained exactly once, the
run makes progress. A naive "oldest completed first" trainer (no forced groups) breaks the bound on the
same draws: the property is not vacuous.
"""

from __future__ import annotations

import heapq
import random

import pytest

from rlctl.algos.admission import Admission


def simulate(batch: int, staleness: int, updates: int, seed: int, *, naive: bool = False, slots: int = 64):
    rng = random.Random(seed)
    adm = Admission(batch, staleness)
    now, events = 0.0, []  # (time, kind, payload)
    start_version: dict[int, int] = {}
    trained_at: dict[int, list[int]] = {}
    running = 0
    trainer_busy_until = 0.0
    version = 0
    while version < updates:
        while adm.can_start() and running < slots:
            g = adm.start()
            start_version[g] = version
            running += 1
            dur = rng.expovariate(1.0) * (20 if rng.random() < 0.1 else 1)  # long tail
            heapq.heappush(events, (now + dur, "done", g))
        if now >= trainer_busy_until:
            if naive:
                done = [i for i, s in adm._untrained.items() if s.completed][:batch]
                picked = done if len(done) == batch else None
            else:
                picked = adm.next_batch()
            if picked is not None:
                for g in picked:
                    trained_at.setdefault(g, []).append(version)
                    s = adm._untrained.pop(g) if naive else None
                    if naive:
                        s.trained_by = version
                if naive:
                    adm.version += 1
                else:
                    adm.train(picked)
                version += 1
                trainer_busy_until = now + rng.uniform(0.1, 2.0)
                heapq.heappush(events, (trainer_busy_until, "trainer", -1))
                continue
        t, kind, g = heapq.heappop(events)
        now = t
        if kind == "done":
            adm.complete(g)
            running -= 1
    return start_version, trained_at, adm


@pytest.mark.parametrize("batch,staleness", [(1, 0), (4, 0), (1, 1), (4, 1), (3, 2), (8, 4)])
def test_staleness_bounded_and_nothing_dropped(batch, staleness):
    for seed in range(30):
        start, trained, adm = simulate(batch, staleness, updates=25, seed=seed)
        assert all(len(v) == 1 for v in trained.values()), "a group trained twice"
        worst = max(trained[g][0] - start[g] for g in trained)
        assert worst <= staleness, (seed, worst)
        # nothing dropped: every started group is trained, or still untrained and counted by admission
        untrained = set(start) - set(trained)
        assert untrained == set(adm._untrained), (seed, untrained)
        assert len(trained) == 25 * batch
        assert len(untrained) <= adm.capacity


def test_naive_oldest_completed_exceeds_the_bound():
    """Without the forced groups a slow group is overtaken and trained later than S allows."""
    worst = 0
    for seed in range(30):
        start, trained, _ = simulate(4, 1, updates=25, seed=seed, naive=True)
        worst = max(worst, max(trained[g][0] - start[g] for g in trained))
    assert worst > 1


def test_zero_staleness_is_synchronous():
    adm = Admission(2, 0)
    a, b = adm.start(), adm.start()
    assert not adm.can_start()  # batch groups in flight, no more
    adm.complete(b)
    assert adm.next_batch() is None  # waits for a
    adm.complete(a)
    assert adm.next_batch() == [a, b]
    assert adm.train([a, b]) == [0, 0]
    assert adm.can_start()


def test_refusals():
    with pytest.raises(ValueError):
        Admission(0, 1)
    adm = Admission(1, 0)
    g = adm.start()
    with pytest.raises(RuntimeError):
        adm.start()
    with pytest.raises(RuntimeError):
        adm.train([g])  # not completed
