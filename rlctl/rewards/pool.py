"""Running rule-reward calls with a per-call timeout: in worker processes (a pool, so a large batch
does not serialise on one core, and a hung call can be killed) or in this process (serial)."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import threading
import time
from typing import Any

from rlctl.rewards.worker import call, read_frame, write_frame

__all__ = ["RewardPool", "Task", "call_with_timeout"]

Task = tuple[str, str, Any]
"""``(spec, kind, args)``: see :func:`rlctl.rewards.worker.call`."""

Outcome = tuple[bool, Any]
"""``(True, result)`` or ``(False, "Type: message")``."""


def _timeout_text(timeout: float) -> str:
    return f"TimeoutError: the reward call took longer than reward.timeout={timeout:g} s"


def call_with_timeout(task: Task, timeout: float, cache: dict) -> Outcome:
    """One call in this process; with ``timeout > 0`` it runs in a daemon thread that is abandoned
    (not killed) when it runs over."""
    if timeout <= 0:
        try:
            return True, call(*task, cache)
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
    box: list[Outcome] = []

    def run() -> None:
        try:
            box.append((True, call(*task, cache)))
        except BaseException as exc:  # noqa: BLE001
            box.append((False, f"{type(exc).__name__}: {exc}"))

    thread = threading.Thread(target=run, daemon=True, name="rlctl-reward")
    thread.start()
    thread.join(timeout)
    return box[0] if box else (False, _timeout_text(timeout))


class _Worker:
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
        try:
            read_frame(self.proc.stdout)  # "ready": start-up does not count against a call's timeout
        except EOFError:
            self.kill()
            raise RuntimeError("a reward worker process failed to start; see its error above") from None

    def send(self, index: int, task: Task) -> None:
        self.index, self.started = index, time.monotonic()
        write_frame(self.proc.stdin, task)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


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
            return [call_with_timeout(t, self.timeout, self._cache) for t in tasks]
        while len(self._workers) < min(self.size, len(tasks)):
            self._workers.append(_Worker())
        results: list[Outcome | None] = [None] * len(tasks)
        todo = list(range(len(tasks)))[::-1]
        busy: dict[int, _Worker] = {}  # stdout fd -> worker
        with selectors.DefaultSelector() as sel:
            idle = list(self._workers)
            while todo or busy:
                while todo and idle:
                    w = idle.pop()
                    i = todo.pop()
                    try:
                        w.send(i, tasks[i])
                    except (BrokenPipeError, OSError):
                        results[i] = (False, "RuntimeError: the reward worker process died")
                        idle.append(self._replace(w))
                        continue
                    busy[w.proc.stdout.fileno()] = w
                    sel.register(w.proc.stdout, selectors.EVENT_READ)
                wait = None
                if self.timeout > 0:
                    first = min(w.started for w in busy.values())
                    wait = max(0.0, first + self.timeout - time.monotonic())
                for key, _ in sel.select(wait):
                    w = busy.pop(key.fd)
                    sel.unregister(key.fileobj)
                    try:
                        results[w.index] = read_frame(w.proc.stdout)
                    except (EOFError, OSError):
                        results[w.index] = (False, "RuntimeError: the reward worker process died")
                        w = self._replace(w)
                    idle.append(w)
                if self.timeout > 0:
                    now = time.monotonic()
                    for fd, w in list(busy.items()):
                        if now - w.started > self.timeout:
                            sel.unregister(w.proc.stdout)
                            del busy[fd]
                            results[w.index] = (False, _timeout_text(self.timeout))
                            idle.append(self._replace(w))
        return results  # type: ignore[return-value]

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        new = _Worker()
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
