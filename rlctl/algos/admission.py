"""Admission control of streaming (fully asynchronous) RL: which group may start, which groups train next.

Pure Python, no torch: the rollout process and the trainer of ``rollout.mode = "stream"`` both read it,
and the property test drives it with random completion times.

Words. A *group* is a prompt's ``n`` samples; an *update* trains ``batch`` groups; the trainer's
*version* is the number of updates done. A group records the version when it starts (``started_at``);
trained by update ``v`` (the update that makes version ``v + 1``), its *staleness* is ``v - started_at``.
In-flight weight updates make a group's later tokens fresher than its first ones; the bound below is on
its oldest token, so it holds for every token.

The two rules, with ``S = max_staleness``:

- **admission**: a group may start only while at most ``batch * (S + 1)`` groups are started but
  untrained (counting itself), so at version ``u`` at most ``(u + S + 1) * batch`` groups have started;
- **the batch**: update ``v`` trains the ``batch`` oldest completed groups (start order), unless that
  would leave more groups due (``started_at + S``) by some later update than the updates up to it can
  train (:meth:`Admission.keeps_bound`); then the trainer waits for the older running groups. Every
  group due at ``v`` is in batch ``v``; the admission cap is the same inequality for a new group, and
  once every running group has completed the oldest ``batch`` always keep it, so the trainer never waits
  forever. (Without the look-ahead, training young groups past a slow old one can leave more than
  ``batch`` groups due at once: the test shows a naive oldest-completed-first trainer exceeding ``S``.)

Together: no group is ever trained more than ``S`` updates after it started, and no group is dropped
(every started group is trained exactly once, a slow one when it finishes). ``S = 0`` is the
synchronous schedule: ``batch`` groups in flight, each update waits for all of them.

**Several producers** (``--rollout-procs N`` in stream mode). The groups are one sequence of indices (the
positions of one prompt stream) shared by every rollout process, and the admission rule is a rule on that
sequence (:func:`admits`): group ``k`` may start while ``k - updates * batch < batch * (S + 1)``, with
``updates`` those of this run the producer knows of (never more than the trainer's, so its view can only be
stricter). A producer claims the next index atomically (a compare-and-set, ``rlctl.recipes.rl.streaming``),
so the cap holds over all producers together and no index is started twice; one :class:`Admission`, the
*keeper*, registers every start with the producer's version (:meth:`Admission.register`) and each completion,
and names every batch. One producer is the case ``N = 1`` of the same code.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def admits(started: int, updates: int, batch: int, max_staleness: int) -> bool:
    """May the group with index ``started`` (the groups this run started before it) start after ``updates``
    updates of this run (a resumed run counts both from its first step)? While fewer than
    ``batch * (max_staleness + 1)`` groups are started but untrained, counting the ones before it:
    ``updates * batch`` groups are trained by then."""
    return started - updates * batch < batch * (max_staleness + 1)


@dataclass
class ProducerView:
    """One producer's side of the rule: the weights version it holds (it learns of updates after the
    trainer) and the run's first version (a resumed run's step: the run's group indices count from there)."""

    batch: int
    max_staleness: int
    version: int
    first: int = -1  # -1: the version given

    def __post_init__(self) -> None:
        self.first = self.version if self.first < 0 else self.first

    def admits(self, index: int) -> bool:
        """May group ``index`` of this run start now?"""
        return admits(index, self.version - self.first, self.batch, self.max_staleness)


@dataclass
class GroupState:
    index: int  # start order
    started_at: int  # the trainer's version when it started
    completed: bool = False
    trained_by: int | None = None  # the update that trained it


@dataclass
class Admission:
    """The bookkeeping of one run: ``batch`` groups per update, staleness at most ``max_staleness``."""

    batch: int
    max_staleness: int
    version: int = 0  # updates done
    groups: dict[int, GroupState] = field(default_factory=dict)
    _untrained: dict[int, GroupState] = field(default_factory=dict)  # started, not yet trained (start order)

    def __post_init__(self) -> None:
        self.first = self.version  # the run's first version (a resumed run's step)
        if self.batch < 1:  # max_staleness >= 0 is the config's rule (rlctl.support, split_values)
            raise ValueError(f"admission: batch >= 1 (got {self.batch})")

    @property
    def capacity(self) -> int:
        """The most groups started but untrained: ``batch * (max_staleness + 1)``."""
        return self.batch * (self.max_staleness + 1)

    @property
    def in_flight(self) -> int:
        """Groups started and not yet completed."""
        return sum(not g.completed for g in self._untrained.values())

    @property
    def queued(self) -> int:
        """Groups completed and not yet trained (``async/queue_groups``)."""
        return sum(g.completed for g in self._untrained.values())

    def can_start(self) -> bool:
        return admits(len(self.groups), self.version - self.first, self.batch, self.max_staleness)

    def next_index(self) -> int:
        """The index the next group to start gets."""
        return len(self.groups)

    def claim(self, index: int) -> bool:
        """Start group ``index`` now if it is the next one and admission lets it (a producer's call: the
        shared version of this is ``rlctl.recipes.rl.streaming.SharedAdmission``)."""
        if index != self.next_index() or not self.can_start():
            return False
        self.start()
        return True

    def start(self) -> int:
        """A new group starts now: its index (start order). Raises when admission refuses it."""
        return self.register(self.version)

    def register(self, started_at: int) -> int:
        """A group a producer started at its ``started_at`` (<= this version: a producer learns of updates
        after the trainer) gets the next index. Raises when admission would have refused it."""
        updates = started_at - self.first
        if started_at > self.version or not admits(len(self.groups), updates, self.batch, self.max_staleness):
            raise RuntimeError(f"admission: {len(self._untrained)} groups started but untrained (cap {self.capacity})")
        g = GroupState(len(self.groups), started_at)
        self.groups[g.index] = self._untrained[g.index] = g
        return g.index

    def complete(self, index: int) -> None:
        g = self._untrained[index]
        if g.completed:
            raise RuntimeError(f"admission: group {index} completed twice")
        g.completed = True

    def forced(self) -> list[int]:
        """The untrained groups the next update must include (started at version <= version - S)."""
        limit = self.version - self.max_staleness
        return [i for i, g in self._untrained.items() if g.started_at <= limit]

    def next_batch(self) -> list[int] | None:
        """The groups of the next update: the ``batch`` oldest completed ones, or None while the trainer
        must wait (fewer completed, or training them would leave an older running group due sooner than
        the updates left before its deadline: :meth:`keeps_bound`)."""
        done = [i for i, g in self._untrained.items() if g.completed]  # dict order: start order
        if len(done) < self.batch or not self.keeps_bound(done[: self.batch]):
            return None
        return done[: self.batch]

    def keeps_bound(self, chosen: list[int]) -> bool:
        """After update ``version`` trains ``chosen``, can every untrained group still be trained by its
        deadline (``started_at + S``)? For each later update ``version + 1 + j`` the groups due by it must
        fit in the ``j + 1`` updates up to it: ``#(started_at <= version + 1 + j - S) <= (j + 1) * batch``,
        for ``j = -1 .. S`` (beyond, the admission cap bounds every untrained group). The admission cap
        keeps the same inequality for new groups, so a state that keeps it can always be completed."""
        taken = set(chosen)
        left = [g.started_at for i, g in self._untrained.items() if i not in taken]
        for j in range(-1, self.max_staleness + 1):
            due = self.version + 1 + j - self.max_staleness
            if sum(s <= due for s in left) > (j + 1) * self.batch:
                return False
        return True

    def train(self, indices: list[int]) -> list[int]:
        """Update ``version`` trains ``indices`` (a :meth:`next_batch`): each group's staleness."""
        if len(indices) != self.batch or not self.keeps_bound(indices):
            raise RuntimeError(f"admission: update {self.version} must train {self.batch} groups incl. {self.forced()}")
        out = []
        for i in indices:
            g = self._untrained.pop(i)
            if not g.completed:
                raise RuntimeError(f"admission: group {i} trained before it completed")
            g.trained_by = self.version
            out.append(self.version - g.started_at)
        self.version += 1
        return out


def staleness_metrics(
    staleness: list[int],
    versions_per_trajectory: list[int],
    *,
    idle_trainer_s: float,
    idle_rollout_s: float,
    queue_groups: int,
    max_staleness: int,
) -> dict[str, float]:
    """One update's ``async/*`` metrics: each trained group's staleness (mean, max, and the share at each
    value 0..S as ``async/staleness_hist/k``), the weights versions per trajectory, the trainer's and the
    rollout's idle seconds, and the completed groups waiting."""
    n = max(1, len(staleness))
    out = {
        "async/staleness": sum(staleness) / n,
        "async/staleness_max": float(max(staleness, default=0)),
        "async/versions_per_trajectory": sum(versions_per_trajectory) / max(1, len(versions_per_trajectory)),
        "async/idle_trainer_s": idle_trainer_s,
        "async/idle_rollout_s": idle_rollout_s,
        "async/queue_groups": float(queue_groups),
    }
    for k in range(max_staleness + 1):
        out[f"async/staleness_hist/{k}"] = sum(s == k for s in staleness) / n
    return out
