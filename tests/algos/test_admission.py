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


# ------------------------------------------------------------------ several producers (--rollout-procs N)


def simulate_producers(batch, staleness, updates, seed, *, producers=2, naive=False, slots=8, first=0):
    """``producers`` rollout processes, each with its own pool of at most ``slots`` running groups and its own
    view of the weights version (each learns of an update after a random delay of its own). Shared: the
    sequence of group indices, claimed in order by whichever producer starts a group next under the global
    rule (:class:`ProducerView`) on the producer's own version, and one keeper :class:`Admission` that registers every
    start (with the producer's version) and completion and names each batch. ``naive``: each producer runs the
    single-process code alone (its own Admission and cap over its own groups) and the trainer trains whichever
    producer's batch is ready first. ``first``: a resumed run's first version (group indices count from 0 again).
    Records, independently of the Admission: each group's producer, the
    version its producer held when it started, the update(s) that trained it."""
    from rlctl.algos.admission import ProducerView

    rng = random.Random(seed)
    keeper = Admission(batch, staleness, version=first)
    local = [Admission(batch, staleness, version=first) for _ in range(producers)]  # naive only
    naive_ids: list[dict[int, int]] = [{} for _ in range(producers)]  # naive: local index -> global id
    views = [ProducerView(batch, staleness, first) for _ in range(producers)]  # each producer's rule
    view = [first] * producers  # the weights version each producer holds (recorded here, independently)
    running = [0] * producers
    now, events, version, busy_until = 0.0, [], first, 0.0
    start_version, owner, trained_at = {}, {}, {}
    while version < first + updates:
        for p in rng.sample(range(producers), producers):  # who claims first: random
            while running[p] < slots:
                if naive:
                    if not local[p].can_start():
                        break
                    g = len(start_version)
                    naive_ids[p][local[p].start()] = g
                else:
                    views[p].version = view[p]
                    if not views[p].admits(len(keeper.groups)):
                        break
                    g = keeper.register(view[p])
                start_version[g], owner[g] = view[p], p
                running[p] += 1
                dur = rng.expovariate(1.0) * (20 if rng.random() < 0.1 else 1)
                heapq.heappush(events, (now + dur, "done", (p, g)))
        if now >= busy_until:
            picked = None
            if naive:
                for p in range(producers):
                    if (b := local[p].next_batch()) is not None:
                        local[p].train(b)
                        picked = [naive_ids[p][i] for i in b]
                        break
            elif (picked := keeper.next_batch()) is not None:
                keeper.train(picked)
            if picked is not None:
                for g in picked:
                    trained_at.setdefault(g, []).append(version)
                version += 1
                busy_until = now + rng.uniform(0.1, 2.0)
                heapq.heappush(events, (busy_until, "trainer", version))
                continue
        now, kind, payload = heapq.heappop(events)
        if kind == "done":
            p, g = payload
            running[p] -= 1
            if naive:
                local[p].complete(next(i for i, j in naive_ids[p].items() if j == g))
            else:
                keeper.complete(g)
        elif kind == "trainer":  # the new weights reach each producer after a delay of its own
            for p in range(producers):
                heapq.heappush(events, (now + rng.uniform(0, 1.5), "weights", (p, payload)))
        else:
            p, v = payload
            view[p] = max(view[p], v)
    return start_version, owner, trained_at, keeper


@pytest.mark.parametrize(
    "producers,batch,staleness,first",
    [(2, 1, 0, 0), (2, 4, 1, 0), (3, 3, 2, 0), (2, 2, 0, 0), (4, 8, 4, 0), (2, 2, 2, 3)],
)
def test_several_producers_keep_the_global_bound(producers, batch, staleness, first):
    """... and a resumed run (``first`` 3: its group indices count from 0 at version 3)."""
    for seed in range(30):
        start, owner, trained, keeper = simulate_producers(batch, staleness, 25, seed, producers=producers, first=first)
        assert all(len(v) == 1 for v in trained.values()), "a group trained twice"
        worst = max(trained[g][0] - start[g] for g in trained)
        assert worst <= staleness, (seed, worst)
        untrained = set(start) - set(trained)
        assert untrained == set(keeper._untrained), (seed, untrained)  # nothing dropped
        assert len(trained) == 25 * batch
        # the global cap: never more than batch x (S + 1) started but untrained, over all producers together
        assert len(untrained) <= batch * (staleness + 1)
        assert len({owner[g] for g in trained}) > 1  # the producers share the work


def test_naive_per_process_admission_exceeds_the_bound():
    """Each producer with its own admission (the single-process rule, N times): together they start up to
    N x batch x (S + 1) groups, and the trainer, one batch per update, trains some later than S allows."""
    worst = 0
    for seed in range(30):
        start, _, trained, _ = simulate_producers(4, 1, 25, seed, producers=2, naive=True)
        worst = max(worst, max(trained[g][0] - start[g] for g in trained))
    assert worst > 1
