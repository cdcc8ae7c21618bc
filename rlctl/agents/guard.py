"""Running a user's code (a tool, an environment method, a verl coroutine) with a timeout, never hanging.

Each call runs in a daemon thread that the caller waits on for at most the timeout; one that runs
over is abandoned (Python cannot kill a thread) and reported as a timeout. Coroutines (verl's async
tools, async TRL tools) run on one background event loop and are cancelled when they run over.
A per-trajectory lock keeps an environment's methods from running concurrently: while an abandoned
call still holds it, later calls of that trajectory fail at once instead of waiting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Result", "error_text", "guarded", "resolve"]

Status = Literal["ok", "error", "timeout", "busy"]


@dataclass(frozen=True)
class Result:
    """What a guarded call gave: ``ok`` (its ``value``), ``error`` (it raised: the exception's type and the
    one-line ``error`` text, ``Type: message``), ``timeout`` (it ran over) or ``busy`` (not run: an earlier
    call of the trajectory still holds its lock). :meth:`why` is a failure's one rendering as text."""

    status: Status
    value: Any = None
    error_type: str = ""
    error: str = ""

    @classmethod
    def raised(cls, error_type: str, error: str) -> Result:
        return cls("error", error_type=error_type, error=error)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def message(self) -> str:
        """The error without its leading ``Type: `` (what TRL and verl show of an exception)."""
        if self.error == self.error_type:
            return ""
        return self.error.removeprefix(f"{self.error_type}: ")

    def why(self, timeout_s: float) -> str:
        """The failure in words: the error text, ``took longer than T s``, or that it was not run."""
        if self.status == "error":
            return self.error
        if self.status == "busy":
            return "was not run: an earlier call is still running"
        return f"took longer than {timeout_s:g} s"


_loop: asyncio.AbstractEventLoop | None = None
_loop_pid = 0
_loop_lock = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():  # a forked child has no loop thread
            _loop = asyncio.new_event_loop()
            _loop_pid = os.getpid()
            threading.Thread(target=_loop.run_forever, daemon=True, name="rlctl-agents-async").start()
        return _loop


class Overrun(TimeoutError):
    """A coroutine cancelled at its deadline."""


async def _await(awaitable):
    return await awaitable


def resolve(value: Any, timeout_s: float) -> Any:
    """``value``, or its result when it is awaitable (run on the background loop, cancelled after timeout_s)."""
    if not inspect.isawaitable(value):
        return value
    future = asyncio.run_coroutine_threadsafe(_await(value), _event_loop())
    try:
        return future.result(timeout_s if timeout_s > 0 else None)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise Overrun(timeout_s) from None  # guarded() reports it as a timeout (Result.why says it)


def error_text(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def guarded(fn: Callable[[], Any], timeout_s: float, lock: threading.Lock | None = None) -> Result:
    """Run ``fn()`` (and await its result) in a daemon thread for at most ``timeout_s`` seconds (0: no limit).

    ``lock`` (one per trajectory) is taken without waiting: when it is held, by a call that ran over
    and is still running, the answer is ``("busy", None)`` at once.
    """
    box: list[Result] = []

    def run() -> None:
        if lock is not None and not lock.acquire(blocking=False):
            box.append(Result("busy"))
            return
        try:
            box.append(Result("ok", resolve(fn(), timeout_s)))
        except Overrun:
            box.append(Result("timeout"))
        except BaseException as exc:  # noqa: BLE001 (any failure of a user's code is that call's error)
            box.append(Result.raised(type(exc).__name__, error_text(exc)))
        finally:
            if lock is not None:
                lock.release()

    thread = threading.Thread(target=run, daemon=True, name="rlctl-agents-call")
    thread.start()
    thread.join(timeout_s if timeout_s > 0 else None)
    if not box:
        thread.join(0.05)  # a coroutine cancelled right at the deadline reports itself
    return box[0] if box else Result("timeout")
