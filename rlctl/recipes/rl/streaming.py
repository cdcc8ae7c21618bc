"""Streaming RL in a split run (``rollout.mode = "stream"``, docs/async.md): one rollout process keeps a
:class:`~rlctl.rollout.streaming.StreamingPool` of in-flight groups and hands the trainers each batch of
the oldest completed groups (:class:`~rlctl.algos.admission.Admission`); after every update trainer 0 sends
the new weights, which enter the running trajectories at the next token boundary.

The transport is the fixed schedule's (:mod:`rlctl.recipes.rl.offpolicy`): weights over the ``sync`` group,
samples over the ``bridge``. The rollout process cannot sit in a broadcast while it generates, so trainer
0 first sends a *notice* over the bridge (``{"weights": v}`` or ``{"stop": True}``) that the rollout
process polls between ticks, then broadcasts as the fixed schedule does.

Group ``k`` of a run is the ``k``-th example of the prompt stream (:meth:`StepSampler.stream`) that no
update has trained yet. A checkpoint records the trained positions (all below ``frontier`` and the few
above it); a resumed run regenerates every other one from the checkpoint's weights, so trajectories in
flight at a checkpoint are never saved half-done and no group is lost.
"""

from __future__ import annotations

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


# ---------------------------------------------------------------------------------------------------- trainer side


class StreamFeed(TrainerFeed):
    """A trainer's end of a streaming run: each step's batch (its prompts are the rollout process's
    choice: :meth:`indices`), the weights after every update, the trained positions for checkpoints."""

    def __init__(self, split, rank, cfg, weights, *, total_steps, device):
        super().__init__(split, rank, cfg, weights, total_steps=total_steps, device=device)
        self.trained = Trained()
        self.pending: dict | None = None
        self.waited = 0.0
        self.notices = Notices(split)

    def _begin(self, step: int) -> None:
        self.start = step
        if self.split.sync is not None:
            _broadcast_header(self.split, self.device, (START, step, DTYPES.index(self.weights.dtype)))
            _broadcast_object(self.split, self.device, self.trained.to_state())
        self._send(step)

    def _notice(self, obj) -> None:
        if self.split.sync is not None:  # trainer 0
            self.notices.send(obj)

    def indices(self, step: int, planned: list[int]) -> list[int]:
        """The dataset indices of step ``step``'s batch, as the rollout process completed it."""
        m: dict[str, float] = {}
        if self.start is None:
            with _timed(m, "time/weight_sync"):
                self._begin(step)
        began = time.perf_counter()
        msg = recv_object(self.split, self.source)
        self.waited = time.perf_counter() - began
        if msg["step"] != step:
            raise RuntimeError(f"streaming feed: the batch of step {msg['step']} arrived for step {step}")
        self.pending = msg | {"metrics": {**m, **msg["metrics"]}}
        self.trained.add(msg["positions"])
        return msg["indices"]

    def samples(self, shares, n, draw, metrics):
        msg, self.pending = self.pending, None
        metrics.update(msg["metrics"])
        metrics["time/rollout_wait"] = metrics["async/idle_trainer_s"] = self.waited
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


# ---------------------------------------------------------------------------------------------------- rollout side


class OneTurn:
    """A single-turn trajectory's episode: nothing follows its turn (the reward is the trainers')."""

    def after_turn(self, turn_ids: list[int]) -> None:
        return None

    def reward(self) -> float:
        return 0.0


class Notices:
    """Trainer 0's notices to the rollout process, through torchrun's store under numbered keys: the
    rollout process polls for the next key between ticks without blocking (a gloo receive cannot be
    polled: its work completes only when waited on)."""

    def __init__(self, split):
        self.store, self.sent, self.taken = split.store, 0, 0

    def send(self, obj) -> None:
        import pickle

        self.store.set(f"n{self.sent}", pickle.dumps(obj))
        self.sent += 1

    def ready(self) -> bool:
        return self.store.check([f"n{self.taken}"])

    def take(self) -> dict:
        """The next notice (waits for it)."""
        import pickle

        obj = pickle.loads(self.store.get(f"n{self.taken}"))  # get waits for the key
        self.store.delete_key(f"n{self.taken}")
        self.taken += 1
        return obj


class StreamRollout:
    """The rollout process of a streaming run (module docstring)."""

    def __init__(self, ctx: RunContext, inputs, start: int, dtype: str, trained: Trained):
        from rlctl.algos.admission import Admission
        from rlctl.recipes.rl.batch import sampling_params
        from rlctl.rollout.streaming import PoolSettings, StreamingPool

        cfg, self.split, self.device = ctx.cfg, ctx.dist.split, ctx.dist.device
        self.cfg, self.worker = cfg, RolloutWorker(ctx, inputs, dtype)
        stream = self.worker.stream
        self.batch, self.total, self.start = stream.batch_size, stream.total_steps, start
        self.admission = Admission(self.batch, cfg.rollout.max_staleness, version=start)
        self.positions = trained.untrained()
        self.position_of: dict[int, int] = {}  # group index -> stream position
        r, loop = cfg.rollout, self.worker.loop
        turns = loop.settings.max_turns if loop is not None else 1
        settings = PoolSettings(r.n, r.stream_chunk, r.max_response_len, turns, slots=max(64, r.n))
        sampling = sampling_params(cfg, start, 0, 1, temperature=r.temperature)
        # a thread per trajectory that may wait on a tool at once: every admitted one
        tools = min(256, max(8, self.batch * (cfg.rollout.max_staleness + 1) * r.n))
        self.pool = StreamingPool(self.worker.engine, self.admission, settings, sampling, self._prompt, tools=tools)
        self.pool.version = start
        self.finished: dict = {}
        self.outstanding: list[int] | None = None
        self.sent, self.idle, self.works = start, 0.0, []

    def _prompt(self, k: int):
        """Group ``k``: the next untrained stream position (admission bounds how many run; the groups still
        running when the trainers stop are dropped with the process, never trained or saved)."""
        pos = next(self.positions)
        self.position_of[k] = pos
        index = self.worker.stream.sampler.stream(pos, 1)[0]
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
        """The weights trainer 0 broadcasts now: the batch sent is trained; running trajectories go on
        with the new version from the next tick."""
        kind, version, _ = _broadcast_header(self.split, self.device)
        if kind != WEIGHTS:
            raise RuntimeError(f"streaming rollout: header {kind} where weights were announced")
        if self.outstanding is not None:
            self.admission.train(self.outstanding)
            self.outstanding = None
        self.pool.set_weights(version, receive_weights(self.split, self.device))

    def dispatch(self, batch: list[int]) -> None:
        """Send each trainer its share of the batch ``batch`` (group indices, oldest first)."""
        from rlctl.algos.admission import staleness_metrics
        from rlctl.recipes.rl.batch import rank_positions
        from rlctl.rollout.streaming import versions_per_trajectory

        groups = [self.finished.pop(i) for i in batch]
        version, trainers = self.admission.version, self.split.trainers
        trajs = [t for g in groups for t in g.trajectories]
        metrics = staleness_metrics(
            [version - g.started_at for g in groups],
            [versions_per_trajectory(t) for t in trajs],
            idle_trainer_s=0.0,
            idle_rollout_s=self.idle + self.pool.idle_s,
            queue_groups=self.admission.queued - len(groups),
            max_staleness=self.admission.max_staleness,
        )
        latency = [g.completed_s - g.started_s for g in groups]  # the cost model's Lat (rlctl.plan.run_async)
        metrics["async/group_latency_mean"] = sum(latency) / max(1, len(latency))
        metrics["async/group_latency_max"] = max(latency, default=0.0)
        self.idle = self.pool.idle_s = 0.0
        indices = [g.prompt for g in groups]
        positions = [self.position_of.pop(g.index) for g in groups]
        mini = self.worker.stream.mini_batch_size
        for i in range(trainers):
            mine = rank_positions(len(groups), mini, i, trainers)
            samples = [self._sample(t, j) for j, p in enumerate(mine) for t in groups[p].trajectories]
            msg = {"step": self.sent, "indices": indices, "positions": positions, "samples": samples}
            self.works.append(send_object(self.split, msg | {"metrics": metrics}, i))
        self.outstanding, self.sent = batch, self.sent + 1

    def run(self) -> None:
        notices = Notices(self.split)
        while True:
            if notices.ready():
                if "stop" in notices.take():
                    _broadcast_header(self.split, self.device)  # the trainers' STOP
                    return
                self.take_weights()
                continue
            if self.outstanding is None and self.sent < self.total:
                if (batch := self.admission.next_batch()) is not None:
                    self.dispatch(batch)
                    continue
            ticks, done = self.pool.ticks, self.pool.step()
            for g in done:
                self.finished[g.index] = g
            # nothing completed (groups whose last tool call just ended complete without a tick: they may
            # make a batch), nothing to generate: wait for the trainers
            if not done and self.pool.ticks == ticks and not self.pool.running:
                began = time.perf_counter()
                while not notices.ready():
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
