"""Streaming RL in a split run (``rollout.mode = "stream"``, docs/async.md): each of the ``rollout.procs``
rollout processes keeps its own :class:`~rlctl.rollout.streaming.StreamingPool` of in-flight groups; admission
is global (:mod:`rlctl.algos.admission`); each batch is the oldest completed groups of all the processes; after
every update trainer 0 sends the new weights to every rollout process, where they enter the running
trajectories at the next token boundary. One rollout process is the case ``N = 1`` of the same code.

The transport is the fixed schedule's (:mod:`rlctl.recipes.rl.offpolicy`): weights over the ``sync`` group,
samples over the ``bridge``. The rollout processes cannot sit in a broadcast or a receive while they
generate, so everything else goes through torchrun's store, which they poll between ticks
(:class:`StreamStore`):

- **the groups**: group ``k`` of a run is the ``k``-th stream position (:meth:`StepSampler.stream`) that no
  update has trained yet; a rollout process claims the next ``k`` with a compare-and-set on one counter, under
  the admission rule on its own weights version (:class:`SharedAdmission`), so no position is generated twice
  and at most ``batch x (S + 1)`` groups are started but untrained over all processes together;
- **the keeper**: trainer 0 registers every start and completion in one
  :class:`~rlctl.algos.admission.Admission` and names each batch (:class:`Keeper`); every rollout process sends
  each trainer its share of the groups it holds, and each trainer receives from every rollout process;
- **the notices**: trainer 0's ``{"weights": v}`` / ``{"stop": True}``, one numbered key per rollout process,
  each followed by the broadcast they announce.

A checkpoint records the trained positions (all below ``frontier`` and the few above it); a resumed run
regenerates every other one from the checkpoint's weights, so trajectories in flight at a checkpoint, in any
rollout process, are never saved half-done and no group is lost or trained twice.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable

from rlctl.recipes.rl.offpolicy import (
    DTYPES,
    START,
    STOP,
    WEIGHTS,
    RolloutWorker,
    TrainerFeed,
    _broadcast_header,
    _broadcast_object,
    _timed,
    receive_weights,
    recv_object,
    send_object,
)
from rlctl.runtime.entry import RunContext


class Trained:
    """The stream positions trained so far: every one below ``frontier``, and ``extra`` above it."""

    def __init__(self, frontier: int = 0, extra: set[int] | None = None):
        self.frontier, self.extra = frontier, set(extra or ())

    def add(self, positions: list[int]) -> None:
        self.extra |= set(positions)
        while self.frontier in self.extra:
            self.extra.remove(self.frontier)
            self.frontier += 1

    def untrained(self):
        """The positions to generate, in order."""
        pos = self.frontier
        while True:
            if pos not in self.extra:
                yield pos
            pos += 1

    def to_state(self) -> dict:
        return {"frontier": self.frontier, "extra": sorted(self.extra)}


# ---------------------------------------------------------------------------------------------------- the store


class StreamStore:
    """The keys of a streaming run on torchrun's store (module docstring): ``g`` the next group index,
    ``s{k}`` group ``k``'s start version, ``nc`` / ``c{i}`` the ``i``-th completion, ``b{t}`` batch ``t``,
    ``n{r}/{i}`` rollout process ``r``'s ``i``-th notice."""

    def __init__(self, store):
        self.store = store

    def count(self, key: str) -> int:
        return int(self.store.add(key, 0))

    def put(self, key: str, obj) -> None:
        self.store.set(key, pickle.dumps(obj))

    def take(self, key: str, *, drop: bool = False):
        """The object under ``key`` (waits for it)."""
        obj = pickle.loads(self.store.get(key))
        if drop:
            self.store.delete_key(key)
        return obj

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def claim(self, k: int, who: int) -> bool:
        """Take group index ``k`` for rollout process ``who``: a compare-and-set on ``o{k}`` from absent, so
        one process wins (the value left is the winner's); either way ``g`` moves past ``k`` (a
        compare-and-set from ``k``: whoever comes first moves it, once)."""
        won = self.store.compare_set(f"o{k}", "", str(who)) == str(who).encode()
        self.store.compare_set("g", str(k), str(k + 1))
        return won

    def completed(self, k: int) -> None:
        self.store.set(f"c{int(self.store.add('nc', 1)) - 1}", str(k))


class Notices:
    """Trainer 0's notices to the rollout processes, under numbered keys, one sequence per process: a rollout
    process polls for its next key between ticks without blocking (a gloo receive cannot be polled: its work
    completes only when waited on)."""

    def __init__(self, split, reader: int = 0):
        self.keys, self.rollouts, self.reader = StreamStore(split.store), split.rollouts, reader
        self.sent = self.taken = 0

    def send(self, obj) -> None:
        for r in range(self.rollouts):
            self.keys.put(f"n{r}/{self.sent}", obj)
        self.sent += 1

    def ready(self) -> bool:
        return self.keys.has(f"n{self.reader}/{self.taken}")

    def take(self) -> dict:
        """The next notice (waits for it)."""
        self.taken += 1
        return self.keys.take(f"n{self.reader}/{self.taken - 1}", drop=True)


# ---------------------------------------------------------------------------------------------------- trainer side


class Keeper:
    """Trainer 0's global admission (:mod:`rlctl.algos.admission`): every group any rollout process started
    or completed, read from the store; each batch named there."""

    def __init__(self, keys: StreamStore, batch: int, max_staleness: int, start: int):
        from rlctl.algos.admission import Admission

        self.keys, self.admission, self.read = keys, Admission(batch, max_staleness, version=start), 0

    def _catch_up(self) -> None:
        adm, keys = self.admission, self.keys
        done = keys.count("nc")  # first: each of these groups was claimed (counted in g) before it completed
        for k in range(len(adm.groups), keys.count("g")):  # started: its version is posted right after the claim
            adm.register(int(keys.take(f"s{k}")))
        for i in range(self.read, done):  # the i-th completion: its key is set right after the count
            adm.complete(int(keys.store.get(f"c{i}")))
        self.read = done

    def name_batch(self, step: int) -> None:
        """Wait for batch ``step`` (:meth:`Admission.next_batch`) and post it with each group's staleness."""
        adm = self.admission
        while True:
            self._catch_up()
            if (batch := adm.next_batch()) is not None:
                break
            time.sleep(0.002)
        queued = adm.queued - len(batch)
        staleness = adm.train(batch)
        self.keys.put(f"b{step}", {"groups": batch, "staleness": staleness, "queue": queued})


class StreamFeed(TrainerFeed):
    """A trainer's end of a streaming run: each step's batch (its prompts are the rollout processes' choice:
    :meth:`indices`), the weights after every update, the trained positions for checkpoints."""

    def __init__(self, split, rank, cfg, weights, *, total_steps, device):
        super().__init__(split, rank, cfg, weights, total_steps=total_steps, device=device)
        self.trained = Trained()
        self.pending: dict | None = None
        self.waited = 0.0
        self.notices = Notices(split)
        self.keeper: Keeper | None = None

    def _begin(self, step: int, batch: int) -> None:
        self.start = step
        if self.split.sync is not None:  # trainer 0
            self.keeper = Keeper(StreamStore(self.split.store), batch, self.cfg.rollout.max_staleness, step)
            _broadcast_header(self.split, self.device, (START, step, DTYPES.index(self.weights.dtype)))
            _broadcast_object(self.split, self.device, self.trained.to_state())
        self._send(step)

    def _notice(self, obj) -> None:
        if self.split.sync is not None:  # trainer 0
            self.notices.send(obj)

    def indices(self, step: int, planned: list[int]) -> list[int]:
        """The dataset indices of step ``step``'s batch, as the keeper named it from the completed groups of
        every rollout process; this trainer's samples from each of them."""
        m: dict[str, float] = {}
        if self.start is None:
            with _timed(m, "time/weight_sync"):
                self._begin(step, len(planned))
        began = time.perf_counter()
        if self.keeper is not None:
            self.keeper.name_batch(step)
        split = self.split
        msgs = [recv_object(split, split.trainers + r) for r in range(split.rollouts)]
        self.waited = time.perf_counter() - began
        if any(msg["step"] != step for msg in msgs):
            raise RuntimeError(f"streaming feed: the batches of steps {[x['step'] for x in msgs]} arrived for {step}")
        self.pending = merge_shares(msgs) | {"extra": m}
        self.trained.add(self.pending["positions"])
        return self.pending["indices"]

    def samples(self, shares, n, draw, metrics):
        from rlctl.algos.admission import staleness_metrics

        msg, self.pending = self.pending, None
        metrics.update(msg["extra"])
        metrics.update(
            staleness_metrics(
                msg["staleness"],
                msg["versions"],
                idle_trainer_s=self.waited,
                idle_rollout_s=msg["idle_rollout_s"],
                queue_groups=msg["queue"],
                max_staleness=self.cfg.rollout.max_staleness,
            )
        )
        metrics.update({f"async/rollout_groups/{r}": float(held) for r, held in enumerate(msg["held"])})
        if lat := msg["latency"]:  # group start to completion (rlctl.plan.run_async reads them)
            metrics["async/group_latency_mean"], metrics["async/group_latency_max"] = sum(lat) / len(lat), max(lat)
        metrics["time/rollout_wait"] = self.waited
        metrics["offpolicy/staleness"] = metrics["async/staleness"]
        return msg["samples"], []

    def after_update(self, step: int) -> dict[str, float]:
        m: dict[str, float] = {}
        if step + 1 < self.total:
            with _timed(m, "time/weight_sync"):
                self._notice({"weights": step + 1})
                self._send(step + 1)
        return m

    def close(self) -> None:
        if self.start is not None:
            self._notice({"stop": True})
        super().close()

    def state(self) -> dict:
        return {"stream_trained": self.trained.to_state()}

    def restore(self, state: dict) -> None:
        t = state.get("stream_trained") or {}
        self.trained = Trained(int(t.get("frontier", 0)), set(t.get("extra", ())))


def merge_shares(msgs: list[dict]) -> dict:
    """One trainer's step from the message of every rollout process: the batch (the keeper's, the same in
    each), this trainer's samples in prompt order (each process sent those of the groups it holds), every
    group's weights versions per trajectory, the rollout processes' mean idle time."""
    shares = sorted((j, i, group) for i, msg in enumerate(msgs) for j, group in msg["groups"])
    if len({j for j, _, _ in shares}) != len(shares):
        raise RuntimeError(f"streaming feed: one group from two rollout processes ({[j for j, _, _ in shares]})")
    return {
        **{k: msgs[0][k] for k in ("indices", "positions", "staleness", "queue")},
        "samples": [sample for _, _, group in shares for sample in group],
        "versions": [v for msg in msgs for v in msg["versions"]],
        "idle_rollout_s": sum(msg["idle_rollout_s"] for msg in msgs) / len(msgs),
        "held": [msg["held"] for msg in msgs],
        "latency": [x for msg in msgs for x in msg["latency"]],
    }


# ---------------------------------------------------------------------------------------------------- rollout side


class OneTurn:
    """A single-turn trajectory's episode: nothing follows its turn (the reward is the trainers')."""

    def after_turn(self, turn_ids: list[int]) -> None:
        return None

    def reward(self) -> float:
        return 0.0


class SharedAdmission:
    """A rollout process's side of the global admission (the pool's ``admission``): it claims group indices
    on the store under the rule of :class:`~rlctl.algos.admission.ProducerView` (the weights version it
    holds), posts each start's version and each completion for the keeper."""

    def __init__(self, keys: StreamStore, view, who: int):
        self.keys, self.view, self.who = keys, view, who
        keys.count("g")  # the counter exists (0) before the first compare-and-set

    def next_index(self) -> int:
        return self.keys.count("g")

    def can_start(self) -> bool:
        return self.view.admits(self.next_index())

    def claim(self, index: int) -> bool:
        if not self.view.admits(index) or not self.keys.claim(index, self.who):
            return False
        self.keys.put(f"s{index}", self.view.version)
        return True

    def complete(self, index: int) -> None:
        self.keys.completed(index)


class StreamRollout:
    """A rollout process of a streaming run (module docstring)."""

    def __init__(self, ctx: RunContext, inputs, start: int, dtype: str, trained: Trained):
        from rlctl.algos.admission import ProducerView
        from rlctl.recipes.rl.batch import sampling_params
        from rlctl.rollout.streaming import PoolSettings, StreamingPool

        cfg, self.split, self.device = ctx.cfg, ctx.dist.split, ctx.dist.device
        self.cfg, self.worker, self.rank = cfg, RolloutWorker(ctx, inputs, dtype), ctx.dist.rank
        stream, self.keys = self.worker.stream, StreamStore(self.split.store)
        self.batch, self.total, self.start = stream.batch_size, stream.total_steps, start
        view = ProducerView(self.batch, cfg.rollout.max_staleness, start)
        self.admission = SharedAdmission(self.keys, view, self.rank)
        self.untrained, self.positions = trained.untrained(), []  # group k -> the k-th untrained position
        r, loop = cfg.rollout, self.worker.loop
        turns = loop.settings.max_turns if loop is not None else 1
        # its share of the groups in flight (the admission's cap, over every process), at most 64 trajectories
        share = -(-self.batch * (r.max_staleness + 1) // self.split.rollouts)
        settings = PoolSettings(r.n, r.stream_chunk, r.max_response_len, turns, slots=max(r.n, min(64, share * r.n)))
        # seeds of its own per rollout process (one process: the seeds of before)
        sampling = sampling_params(cfg, start, self.rank, self.split.rollouts, temperature=r.temperature)
        # a thread per trajectory that may wait on a tool at once: every admitted one
        tools = min(256, max(8, self.batch * (cfg.rollout.max_staleness + 1) * r.n))
        self.pool = StreamingPool(self.worker.engine, self.admission, settings, sampling, self._prompt, tools=tools)
        self.pool.version = start
        self.finished: dict = {}
        self.sent, self.idle, self.works = start, 0.0, []

    def position(self, k: int) -> int:
        while len(self.positions) <= k:
            self.positions.append(next(self.untrained))
        return self.positions[k]

    def _prompt(self, k: int):
        """Group ``k``: the ``k``-th untrained stream position (a pure function of ``k``: another process
        may claim ``k`` first; the groups still running when the trainers stop are dropped with the process,
        never trained or saved)."""
        index = self.worker.stream.sampler.stream(self.position(k), 1)[0]
        prompt, n = self.worker.data.train[index], self.cfg.rollout.n
        return index, prompt.token_ids, self._episodes(prompt, n)

    def _episodes(self, prompt, n: int) -> list:
        """A group's ``n`` episodes: single-turn, or the agent loop's trajectories turn by turn (their tool
        calls run in the pool's threads while the others generate)."""
        if self.worker.loop is None:
            return [OneTurn() for _ in range(n)]
        from rlctl.agents.loop import TurnByTurn
        from rlctl.recipes.rl.turns import agent_prompt

        spec, ask = self.worker.agent_spec, agent_prompt(self.cfg, prompt)
        spec.prepare(n)
        return [TurnByTurn(self.worker.loop, ask, spec.open(prompt.row), 0) for _ in range(n)]

    def _sample(self, t, j: int):
        """A finished trajectory as the trainers take it: the engine's sample (single-turn) or the agent
        loop's :class:`~rlctl.agents.trajectory.Trajectory`; ``j`` its prompt among a trainer's."""
        from rlctl.rollout.base import Sample

        truncated = t.finish_reason == "length"
        if isinstance(t.episode, OneTurn):
            return Sample(j, t.token_ids, t.logprobs, "length" if truncated else "stop")
        traj = t.episode.finish(t.token_ids, t.mask, t.logprobs, truncated)
        traj.prompt_index = j
        return traj

    def take_weights(self) -> None:
        """The weights trainer 0 broadcasts now: running trajectories go on with the new version from the
        next tick, and admission counts the update."""
        kind, version, _ = _broadcast_header(self.split, self.device)
        if kind != WEIGHTS:
            raise RuntimeError(f"streaming rollout: header {kind} where weights were announced")
        self.pool.set_weights(version, receive_weights(self.split, self.device))
        self.admission.view.version = version

    def dispatch(self, named: dict) -> None:
        """Batch ``sent`` as the keeper named it (group indices, oldest first): send each trainer its share
        of the groups this process holds (maybe none) and the batch's facts."""
        from rlctl.recipes.rl.batch import rank_positions
        from rlctl.rollout.streaming import versions_per_trajectory

        batch, trainers = named["groups"], self.split.trainers
        mine = {p: self.finished.pop(k) for p, k in enumerate(batch) if k in self.finished}
        positions = [self.position(k) for k in batch]
        indices = [self.worker.stream.sampler.stream(pos, 1)[0] for pos in positions]
        facts = {
            "step": self.sent,
            "indices": indices,
            "positions": positions,
            "staleness": named["staleness"],
            "queue": named["queue"],
            "versions": [versions_per_trajectory(t) for g in mine.values() for t in g.trajectories],
            "idle_rollout_s": self.idle + self.pool.idle_s,
            "held": len(mine),
            "latency": [g.completed_s - g.started_s for g in mine.values()],  # the cost model's Lat
        }
        self.idle = self.pool.idle_s = 0.0
        mini = self.worker.stream.mini_batch_size
        for i in range(trainers):
            share = rank_positions(len(batch), mini, i, trainers)
            groups = [(j, [self._sample(t, j) for t in mine[p].trajectories]) for j, p in enumerate(share) if p in mine]
            self.works.append(send_object(self.split, facts | {"groups": groups}, i))
        self.sent += 1

    def is_named(self) -> bool:
        """Has the keeper named batch ``sent``?"""
        return self.sent < self.total and self.keys.has(f"b{self.sent}")

    def named(self) -> dict | None:
        """Batch ``sent`` once the keeper has named it."""
        return self.keys.take(f"b{self.sent}") if self.is_named() else None

    def run(self) -> None:
        notices = Notices(self.split, self.rank)
        while True:
            if notices.ready():
                if "stop" in notices.take():
                    _broadcast_header(self.split, self.device)  # the trainers' STOP
                    return
                self.take_weights()
                continue
            if (named := self.named()) is not None:
                self.dispatch(named)
                continue
            ticks, done = self.pool.ticks, self.pool.step()
            for g in done:
                self.finished[g.index] = g
            # nothing completed (groups whose last tool call just ended complete without a tick: they may
            # make a batch), nothing to generate: wait for the trainers or the keeper
            if not done and self.pool.ticks == ticks and not self.pool.running:
                began = time.perf_counter()
                while not notices.ready() and not self.is_named():
                    time.sleep(0.002)
                self.idle += time.perf_counter() - began


def stream_rollout_main(ctx: RunContext, inputs: Callable) -> None:
    """A streaming run's rollout process: the trainers' START, the run's ``inputs`` (built as the trainers
    built theirs), the trained positions, the first weights, then :meth:`StreamRollout.run` until the
    trainers' STOP."""
    split, device = ctx.dist.split, ctx.dist.device
    kind, start, dtype = _broadcast_header(split, device)
    if kind == STOP:
        return
    t = _broadcast_object(split, device)
    roll = StreamRollout(ctx, inputs(), start, DTYPES[dtype], Trained(int(t["frontier"]), set(t["extra"])))
    kind, version, _ = _broadcast_header(split, device)
    if kind == STOP:
        return
    roll.pool.set_weights(version, receive_weights(split, device))
    try:
        roll.run()
    finally:
        roll.pool.close()
