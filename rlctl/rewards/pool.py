"""Running rule-reward calls with a per-call timeout: in worker processes (a pool, so a large batch
does not serialise on one core, and a hung call can be killed) or in this process (serial).

A step's calls that hang time out together, not one after another: once a call has run longer than a
quarter of ``reward.timeout``, the calls of the step not yet started get a process each at once
(temporary ones, at most :data:`MAX_BURST`), which must finish within one timeout of that moment
(their start-up included), so a step whose reward function hangs on every sample ends after about
1.25 timeouts. In this process (``reward.workers=0``) the same holds, with threads (abandoned, not
killed, when they run over). A stop request (Ctrl-C, SIGTERM: :mod:`rlctl.runtime.signals`) ends
the calls still running after :data:`STOP_GRACE` seconds: their workers are killed and the step
raises KeyboardInterrupt (the run stops as at a second Ctrl-C, keeping its last checkpoint)."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import threading
import time
from typing import Any

from rlctl.rewards.worker import call, error_text, read_frame, stop_worker, write_frame
from rlctl.runtime.signals import stop_requested

__all__ = ["RewardPool", "Task", "call_with_timeout"]

Task = tuple[str, str, Any]
"""``(spec, kind, args)``: see :func:`rlctl.rewards.worker.call`."""

Outcome = tuple[bool, Any]
"""``(True, result)`` or ``(False, "Type: message (file.py:LINE)")``."""

SLOW_SHARE = 0.25  # a call running longer than this share of the timeout: start the step's other calls at once
MAX_BURST = 32  # temporary worker processes per rank, at most, for a step whose calls hang
STOP_GRACE = 2.0  # seconds the calls still running may take after a stop request


def _timeout_text(timeout: float) -> str:
    return f"TimeoutError: the reward call took longer than reward.timeout={timeout:g} s"


def call_with_timeout(task: Task, timeout: float, cache: dict) -> Outcome:
    """One call in this process; with ``timeout > 0`` it runs in a daemon thread that is abandoned
    (not killed) when it runs over."""
    return _threads([task], timeout, cache)[0]


def _threads(tasks: list[Task], timeout: float, cache: dict) -> list[Outcome]:
    """``tasks`` in this process, each in a daemon thread, all at once, under one deadline."""
    if timeout <= 0:
        return [_guarded(t, cache) for t in tasks]
    boxes: list[list[Outcome]] = [[] for _ in tasks]
    threads = [
        threading.Thread(target=lambda t=t, b=b: b.append(_guarded(t, cache)), daemon=True, name="rlctl-reward")
        for t, b in zip(tasks, boxes)
    ]
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [b[0] if b else (False, _timeout_text(timeout)) for b in boxes]


def _guarded(task: Task, cache: dict) -> Outcome:
    try:
        return True, call(*task, cache)
    except BaseException as exc:  # noqa: BLE001 (any failure of a user's function is that sample's error)
        return False, error_text(exc)


def _serial(tasks: list[Task], timeout: float, cache: dict) -> list[Outcome]:
    """One after another while the calls are fast; once one is slower than SLOW_SHARE of the timeout,
    the rest run together with it, in threads, within one timeout."""
    if timeout <= 0:
        return [_guarded(t, cache) for t in tasks]
    out: list[Outcome] = []
    for i, task in enumerate(tasks):
        box: list[Outcome] = []
        thread = threading.Thread(
            target=lambda t=task, b=box: b.append(_guarded(t, cache)), daemon=True, name="rlctl-reward"
        )
        began = time.monotonic()
        thread.start()
        thread.join(SLOW_SHARE * timeout)
        if box:
            out.append(box[0])
            continue
        rest = _threads(tasks[i + 1 :], timeout, cache)  # while this one runs on
        thread.join(max(0.0, began + timeout - time.monotonic()))
        return [*out, box[0] if box else (False, _timeout_text(timeout)), *rest]
    return out


class _Worker:
    """A reward worker process; :meth:`ready` waits for its start-up (which no call's timeout counts)."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path] if p)  # resolve modules as this process does
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from rlctl.rewards.worker import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.index: int | None = None
        self.started = 0.0

    def ready(self) -> _Worker:
        try:
            read_frame(self.proc.stdout)  # "ready"
        except EOFError:
            self.kill()
            raise RuntimeError("a reward worker process failed to start; see its error above") from None
        return self

    def send(self, index: int, task: Task) -> None:
        self.index, self.started = index, time.monotonic()
        write_frame(self.proc.stdin, task)

    def kill(self) -> None:
        stop_worker(self.proc)


def _start(n: int) -> list[_Worker]:
    """``n`` workers started together (their start-ups overlap)."""
    workers = [_Worker() for _ in range(n)]
    return [w.ready() for w in workers]


class RewardPool:
    """``workers`` reward processes, started on first use and kept for the run.

    :meth:`map` gives each task to an idle worker; a call that runs over ``timeout`` seconds (0: no
    limit) has its worker killed and replaced, and counts as failed; so does a worker that dies.
    ``workers=0`` runs the calls serially in this process (:func:`call_with_timeout`).
    """

    def __init__(self, workers: int, timeout: float):
        self.size, self.timeout = max(0, int(workers)), float(timeout)
        self._workers: list[_Worker] = []
        self._cache: dict = {}

    def map(self, tasks: list[Task]) -> list[Outcome]:
        if not tasks:
            return []
        if self.size == 0:
            return _serial(tasks, self.timeout, self._cache)
        if len(self._workers) < min(self.size, len(tasks)):
            self._workers += _start(min(self.size, len(tasks)) - len(self._workers))
        step = _Step(self, tasks)
        try:
            return step.run()
        finally:
            step.close()

    def replace(self, worker: _Worker) -> _Worker:
        """A new worker in place of ``worker`` (killed); a temporary one is not replaced (None)."""
        worker.kill()
        if worker not in self._workers:
            return None  # type: ignore[return-value]
        new = _Worker().ready()
        self._workers[self._workers.index(worker)] = new
        return new

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class _Step:
    """One :meth:`RewardPool.map`: the tasks, the busy workers, the temporary ones of a hanging step."""

    def __init__(self, pool: RewardPool, tasks: list[Task]):
        self.pool, self.tasks, self.timeout = pool, tasks, pool.timeout
        self.results: list[Outcome | None] = [None] * len(tasks)
        self.todo = list(range(len(tasks)))[::-1]
        self.idle = list(pool._workers)
        self.busy: dict[int, _Worker] = {}  # stdout fd -> worker
        self.extra: list[_Worker] = []  # temporary workers (a hanging step)
        self.stop_seen: float | None = None
        self.burst_deadline = 0.0  # when the temporary workers' calls must have finished
        self.deadline: dict[int, float] = {}  # task -> when its call times out
        self.sel = selectors.DefaultSelector()

    def run(self) -> list[Outcome]:
        while self.todo or self.busy:
            self._dispatch()
            wait = 0.5 if self.timeout <= 0 else min(0.5, max(0.0, self._next_deadline() - time.monotonic()))
            for key, _ in self.sel.select(wait):
                self._collect(self.busy.pop(key.fd))
            self._expire()
            self._burst()
            self._check_stop()
        return self.results  # type: ignore[return-value]

    def _dispatch(self) -> None:
        while self.todo and self.idle:
            w, i = self.idle.pop(), self.todo.pop()
            try:
                w.send(i, self.tasks[i])
            except (BrokenPipeError, OSError):
                self.results[i] = (False, "RuntimeError: the reward worker process died")
                self._requeue(w)
                continue
            own = w.started + self.timeout
            self.deadline[i] = (
                max(self.burst_deadline, w.started + SLOW_SHARE * self.timeout) if w in self.extra else own
            )
            self.busy[w.proc.stdout.fileno()] = w
            self.sel.register(w.proc.stdout, selectors.EVENT_READ)

    def _collect(self, w: _Worker) -> None:
        self.sel.unregister(w.proc.stdout)
        try:
            self.results[w.index] = read_frame(w.proc.stdout)
        except (EOFError, OSError):
            self.results[w.index] = (False, "RuntimeError: the reward worker process died")
            self._requeue(w)
            return
        self.idle.append(w)

    def _requeue(self, dead: _Worker) -> None:
        new = self.pool.replace(dead)
        if new is not None:
            self.idle.append(new)

    def _next_deadline(self) -> float:
        return min((self.deadline[w.index] for w in self.busy.values()), default=time.monotonic() + 0.5)

    def _expire(self) -> None:
        if self.timeout <= 0:
            return
        now = time.monotonic()
        for fd, w in list(self.busy.items()):
            if now > self.deadline[w.index]:
                self.sel.unregister(w.proc.stdout)
                del self.busy[fd]
                self.results[w.index] = (False, _timeout_text(self.timeout))
                self._requeue(w)

    def _burst(self) -> None:
        """A call slower than SLOW_SHARE of the timeout: the calls not started yet start now, together."""
        if self.timeout <= 0 or not self.todo or len(self.extra) >= MAX_BURST:
            return
        now = time.monotonic()
        if not any(now - w.started > SLOW_SHARE * self.timeout for w in self.busy.values()):
            return
        n = min(len(self.todo) - len(self.idle), MAX_BURST - len(self.extra))
        self.burst_deadline = self.burst_deadline or now + self.timeout  # their start-up counts against it
        new = _start(n) if n > 0 else []
        self.extra += new
        self.idle += new

    def _check_stop(self) -> None:
        if not stop_requested() or not self.busy:
            return
        now = time.monotonic()
        self.stop_seen = self.stop_seen or now
        if now - self.stop_seen > STOP_GRACE:
            raise KeyboardInterrupt("stopped while reward calls were still running")

    def close(self) -> None:
        """Kill the temporary workers, and any still busy (a stop): the pool replaces its own."""
        self.sel.close()
        for w in self.busy.values():  # a stop: the next map starts new ones
            w.kill()
            if w in self.pool._workers:
                self.pool._workers.remove(w)
        for w in self.extra:
            w.kill()
