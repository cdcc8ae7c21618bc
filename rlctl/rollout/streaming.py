"""Streaming rollouts with in-flight weight updates (``rollout.mode = "stream"``, docs/async.md).

:class:`StreamingPool` keeps a pool of in-flight trajectories (single- or multi-turn) on any
:class:`~rlctl.rollout.base.RolloutEngine` and hands each group (a prompt's ``n`` trajectories) out as soon
as all of them finish. Work advances in *ticks*: one :meth:`~rlctl.rollout.base.RolloutEngine.
continue_generation` call over every trajectory that is generating, at most ``chunk`` tokens each. Between
ticks (a token boundary):

- new groups start while :class:`rlctl.algos.admission.Admission` lets them (``--max-staleness``);
- tool calls / environment steps that finished are appended; those still running keep running in a thread
  pool while the next tick generates the other trajectories (sleeping tools cost no CPU);
- new weights are taken (:meth:`StreamingPool.set_weights`): the running trajectories pause, the engine
  loads the weights, and the next tick continues them with the new version.

Every sampled token records the version of the weights that sampled it and its behaviour log-prob (the
engine's, of the distribution it sampled from), so the trainer can weight each token against the policy
that produced it (:mod:`rlctl.algos.correction`, or the decoupled objective of :mod:`rlctl.algos.decoupled`).

**The KV cache across a swap is recomputed, never kept.** Keys and values computed by the old weights are
not what the new weights compute for the same prefix; decoding on from them samples from a mixture that
no policy's forward reproduces, so the recorded log-prob would not be any policy's and the importance
weights would be wrong by an unknown amount (PipelineRL keeps them and accepts that; AReaL and verl's
partial rollout recompute). The hf engine keeps each trajectory's keys and values between ticks inside a
session (:meth:`~rlctl.rollout.base.RolloutEngine.start_session`) and the pool ends the session at every
swap, so the first tick after it prefills each trajectory with the new weights. vLLM / SGLang: every tick
resubmits each trajectory's prefix as a new request (what verl's partial rollout does after an abort); their
prefix caches serve the prefix within a version and are reset by their weight update, which raises if the
engine refuses the reset (tests/rollout/test_streaming_vllm.py runs a real vLLM; docs/async.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

from rlctl.algos.admission import Admission

SEED_STRIDE = 104_729  # tick k samples with seed + k * SEED_STRIDE


class Episode(Protocol):
    """One trajectory's environment: what follows each sampled turn (runs in a worker thread)."""

    def after_turn(self, turn_ids: list[int]) -> list[int] | None:
        """The tokens to append after the turn just sampled (a tool result, a user reply), or None: done."""

    def reward(self) -> float: ...

    # optional: ``prompt_ids``, the trajectory's own prompt when it differs from its group's (an agent
    # environment's reset may append to the prompt: rlctl.agents.loop.TurnByTurn)


@dataclass
class StreamTrajectory:
    group: int
    prompt_ids: list[int]
    episode: Episode
    token_ids: list[int] = field(default_factory=list)  # the response: sampled and appended tokens
    mask: list[int] = field(default_factory=list)  # 1: sampled (trained on), 0: appended context
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob (0 on context tokens)
    versions: list[int] = field(default_factory=list)  # the weights version that sampled it (-1: context)
    turn_start: int = 0  # where the current turn's sampled tokens begin
    turns: int = 0
    finish_reason: str | None = None
    pending: Future | None = None  # the running tool call / environment step
    reward: float = 0.0

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.token_ids


@dataclass
class StreamGroup:
    index: int  # start order (the admission's)
    prompt: int  # the prompt's index in the run's data
    started_at: int  # the weights version when it started
    trajectories: list[StreamTrajectory]
    started_s: float = field(default_factory=time.perf_counter)
    completed_s: float = 0.0


@dataclass
class PoolSettings:
    n: int  # trajectories per group
    chunk: int  # tokens per tick
    max_response_len: int
    max_turns: int
    slots: int  # the most trajectories generating at once (the engine's batch)


class StreamingPool:
    """The rollout side of streaming RL: ``prompts(k)`` gives the k-th group's (prompt index, ids, episodes)."""

    def __init__(self, engine, admission: Admission, settings: PoolSettings, sampling, prompts: Callable, *, tools=8):
        self.engine, self.admission, self.settings, self.sampling = engine, admission, settings, sampling
        self.prompts = prompts
        self.version = 0
        self.running: dict[int, StreamGroup] = {}
        self.ticks = 0
        self.executor = ThreadPoolExecutor(max_workers=tools, thread_name_prefix="rlctl-tool")
        self.idle_s = 0.0  # waiting with nothing to generate (every running trajectory in a tool call)
        engine.start_session()

    # ------------------------------------------------------------------ weights

    def set_weights(self, version: int, named_tensors: Iterable) -> None:
        """New weights at a token boundary: the engine loads them; every KV cache it kept is dropped."""
        self.engine.end_session()
        self.engine.trainer_stepped()
        self.engine.ready(lambda: self.engine.update_weights(named_tensors))
        self.engine.start_session()
        self.version = version

    # ------------------------------------------------------------------ the loop

    def admit(self) -> None:
        """Start groups while admission lets them and the engine has slots. ``admission`` is a local
        :class:`Admission` or the shared one of several rollout processes, whose :meth:`~Admission.claim`
        fails when another process took the index first (then the next index is tried)."""
        s = self.settings
        while self.admission.can_start() and self._generating_slots() + s.n <= max(s.slots, s.n):
            index = self.admission.next_index()
            got = self.prompts(index)
            if got is None:  # the run's prompts are over
                return
            if not self.admission.claim(index):
                continue
            prompt, ids, episodes = got
            trajs = [StreamTrajectory(index, list(getattr(ep, "prompt_ids", None) or ids), ep) for ep in episodes]
            self.running[index] = StreamGroup(index, prompt, self.version, trajs)

    def _generating_slots(self) -> int:
        return sum(t.finish_reason is None for g in self.running.values() for t in g.trajectories)

    def step(self) -> list[StreamGroup]:
        """One tick: admit, append finished tool results, generate ``chunk`` tokens for every generating
        trajectory (or wait for a tool when none is); the groups that completed."""
        self.admit()
        trajs = [t for g in self.running.values() for t in g.trajectories if t.finish_reason is None]
        for t in trajs:
            if t.pending is not None and t.pending.done():
                self._appended(t, t.pending.result())
        going = [t for t in trajs if t.finish_reason is None and t.pending is None]
        if going:
            self._tick(going)
        elif any(t.pending is not None for t in trajs):
            began = time.perf_counter()
            wait_any([t.pending for t in trajs if t.pending is not None])
            self.idle_s += time.perf_counter() - began
        return self._completed()

    def _tick(self, going: list[StreamTrajectory]) -> None:
        s = self.settings
        budgets = [min(s.chunk, s.max_response_len - len(t.token_ids)) for t in going]
        seed = None if self.sampling.seed is None else self.sampling.seed + self.ticks * SEED_STRIDE
        out = self.engine.continue_generation([t.history for t in going], replace(self.sampling, seed=seed), budgets)
        self.ticks += 1
        for t, sample in zip(going, out, strict=True):
            t.token_ids += sample.token_ids
            t.mask += [1] * len(sample.token_ids)
            t.logprobs += list(sample.logprobs)
            t.versions += [self.version] * len(sample.token_ids)
            if len(t.token_ids) >= s.max_response_len:
                t.finish_reason = "length"
            elif sample.finish_reason == "stop":  # the turn is over: its tool calls run beside the next ticks
                t.turns += 1
                turn = t.token_ids[t.turn_start :]
                t.pending = self.executor.submit(t.episode.after_turn, turn)

    def _appended(self, t: StreamTrajectory, extra: list[int] | None) -> None:
        t.pending = None
        if extra is None:
            t.finish_reason = "stop"
        elif t.turns >= self.settings.max_turns:
            t.finish_reason = "max_turns"
        elif len(t.token_ids) + len(extra) >= self.settings.max_response_len:
            t.finish_reason = "length"  # no room left to answer: the result is not appended
        else:
            t.token_ids += extra
            t.mask += [0] * len(extra)
            t.logprobs += [0.0] * len(extra)
            t.versions += [-1] * len(extra)
            t.turn_start = len(t.token_ids)

    def _completed(self) -> list[StreamGroup]:
        done = [g for g in self.running.values() if all(t.finish_reason for t in g.trajectories)]
        for g in done:
            del self.running[g.index]
            for t in g.trajectories:
                t.reward = float(t.episode.reward())
            g.completed_s = time.perf_counter()
            self.admission.complete(g.index)
        return done

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.engine.end_session()


def wait_any(futures: list[Future]) -> None:
    from concurrent.futures import FIRST_COMPLETED, wait

    wait(futures, return_when=FIRST_COMPLETED)


def versions_per_trajectory(t: StreamTrajectory) -> int:
    """How many weights versions sampled the trajectory's tokens (``async/versions_per_trajectory``)."""
    return len({v for v in t.versions if v >= 0})
