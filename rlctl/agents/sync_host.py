"""Synchronous tools on the main thread of a worker process of their own (the one place they run).

TRL calls a sync tool, an environment's methods and its ``reset`` / ``get_reward`` on its main thread, so
main-thread-only APIs work in them: ``signal.alarm`` (TRL's own SQL example times its queries with it),
``signal.signal``, libraries that install signal handlers. rlctl runs them the same way, in a process:

* each trajectory with Python tools or an environment class gets a :class:`SyncHost` process for its life
  (:class:`EpisodeHost`); its functions file is imported there, its environment instance lives there, and
  every call runs on that process's main thread (an ``async def`` tool on that process's event loop);
* a call that runs over ``agent.tool_timeout_s`` has its process killed: nothing of it keeps running. A
  trajectory of plain functions gets a fresh process for its next call; a trajectory whose environment was
  in it has lost that environment, and its later calls and reward are errors saying so;
* processes are reused by later trajectories once a trajectory ends (:func:`warm` starts a batch's at once).

Only text crosses the pipe: the tool's value is made text in the worker (:func:`rlctl.agents.calls.
result_text`, in the run's ``agent.tool_results`` style), errors as ``(type, "Type: message")``; the
trajectory's side turns each reply into a :class:`rlctl.agents.guard.Result`.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import select
import subprocess
import sys
import threading
from typing import Any

from rlctl.agents.guard import Result, error_text
from rlctl.rewards.worker import read_frame, stop_worker, write_frame

__all__ = ["EpisodeHost", "SyncHost", "main", "warm"]

START_TIMEOUT_S = 120.0  # a worker's start-up (Python and rlctl.agents.loading), not counted in any call's timeout
LOST = "the environment was lost: its process was stopped when an earlier call ran over the timeout"


class SyncHost:
    """A worker process (``python -c 'from rlctl.agents.sync_host import main; main()'``) and its pipe."""

    def __init__(self):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # resolve modules as this process does
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from rlctl.agents.sync_host import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.ready = False

    def wait_ready(self) -> bool:
        if not self.ready:
            self.ready = self._read(START_TIMEOUT_S) == "ready"
            if not self.ready:
                self.kill()
        return self.ready

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self, timeout_s: float) -> Any:
        """The next reply, or None on a timeout (0: none) or a closed pipe."""
        out = self.proc.stdout
        if timeout_s > 0 and not select.select([out], [], [], timeout_s)[0]:
            return None
        try:
            return read_frame(out)
        except (EOFError, OSError):
            return None

    def ask(self, request: tuple, timeout_s: float) -> Result:
        """The worker's reply: ok, an error, or a timeout (the process killed)."""
        try:
            write_frame(self.proc.stdin, request)
        except (BrokenPipeError, OSError):
            return Result.raised("RuntimeError", "the tool worker process died")
        reply = self._read(timeout_s)
        if reply is None:
            timed_out = self.alive
            self.kill()
            if timed_out:
                return Result("timeout")
            return Result.raised("RuntimeError", f"the tool worker process died (exit code {self.proc.returncode})")
        status, value = reply
        return Result("ok", value) if status == "ok" else Result.raised(*value)

    def kill(self) -> None:
        stop_worker(self.proc)


_idle: list[SyncHost] = []
_idle_lock = threading.Lock()


def warm(count: int) -> None:
    """At least ``count`` idle processes, the missing ones started together (their start-ups overlap)."""
    with _idle_lock:
        _idle[:] = [h for h in _idle if h.alive]
        new = [SyncHost() for _ in range(max(0, count - len(_idle)))]
    ready = [h for h in new if h.wait_ready()]
    with _idle_lock:
        _idle.extend(ready)


def _lease() -> SyncHost:
    with _idle_lock:
        while _idle:
            host = _idle.pop()
            if host.alive:
                return host
    host = SyncHost()
    if not host.wait_ready():
        raise RuntimeError("a tool worker process failed to start; see its error above")
    return host


def _give_back(host: SyncHost, timeout_s: float) -> None:
    if host.alive and host.ask(("reset",), timeout_s).ok:
        with _idle_lock:
            _idle.append(host)
    else:
        host.kill()


class EpisodeHost:
    """One trajectory's sync tools: the setup requests (a functions file, an environment and its row) replayed
    on the process it leases, then its calls."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.setup: list[tuple] = []
        self.host: SyncHost | None = None
        self.lost = False  # its environment died with a killed process
        self.stateful = False

    def add(self, request: tuple) -> Result:
        """Run a setup request now (leasing a process) and keep it for a fresh process after a timeout."""
        self.setup.append(request)
        self.stateful = self.stateful or request[0] == "env"
        return self._ask(request)

    def _ask(self, request: tuple, timeout_s: float | None = None) -> Result:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self.lost:
            return Result.raised("RuntimeError", LOST)
        if self.host is None or not self.host.alive:
            try:
                self.host = _lease()
            except RuntimeError as exc:
                return Result.raised("RuntimeError", str(exc))
            for earlier in self.setup:
                if earlier is not request:
                    replayed = self.host.ask(earlier, self.timeout_s)
                    if not replayed.ok:
                        return replayed
        result = self.host.ask(request, timeout_s)
        if result.status == "timeout" and self.stateful:
            self.lost = True
        return result

    def call(self, name: str, arguments: dict, timeout_s: float, *, style: str) -> Result:
        return self._ask(("call", name, arguments, style), timeout_s)

    def reward(self) -> Result:
        return self._ask(("reward",))

    def close(self) -> None:
        host, self.host = self.host, None
        if host is not None and not self.lost:
            _give_back(host, self.timeout_s)
        elif host is not None:
            host.kill()


# ------------------------------------------------------------------ the worker process


class _Worker:
    """What one worker process holds: the tool functions loaded, and the current trajectory's environment."""

    def __init__(self):
        self.functions: dict[str, Any] = {}
        self.env: Any = None
        self.env_tools: dict[str, Any] = {}
        self.loop = asyncio.new_event_loop()

    def resolve(self, value: Any) -> Any:
        return self.loop.run_until_complete(value) if inspect.isawaitable(value) else value

    def handle(self, request: tuple) -> Any:
        from rlctl.agents.calls import result_text
        from rlctl.agents.loading import call_with_row, env_tool_names, load_class, load_functions

        op = request[0]
        if op == "functions":
            self.functions.update(load_functions(request[1])[0])
            return None
        if op == "env":
            cls = load_class(request[1], "environment")
            self.env = cls()
            self.env_tools = {n: getattr(self.env, n) for n in env_tool_names(cls)}
            reset = getattr(self.env, "reset", None)
            return self.resolve(call_with_row(reset, request[2])) if callable(reset) else None
        if op == "call":
            _, name, arguments, style = request
            fn = self.env_tools.get(name) or self.functions[name]
            return result_text(self.resolve(fn(**arguments)), style)
        if op == "reward":
            return float(self.resolve(self.env.get_reward()))
        if op == "reset":
            if self.env is not None and callable(getattr(self.env, "close", None)):
                self.resolve(self.env.close())
            self.env, self.env_tools = None, {}
            return None
        raise ValueError(f"unknown request {op!r}")


def main() -> None:
    """The worker's loop: a request in, ``(status, value)`` out, on this process's main thread."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which closes our stdin
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the tools' prints go to stderr
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    import rlctl.agents.loading  # noqa: F401 (before "ready": a call's timeout excludes start-up)

    worker = _Worker()
    write_frame(proto_out, "ready")
    while True:
        try:
            request = read_frame(inp)
        except EOFError:
            return
        try:
            reply: tuple = ("ok", worker.handle(request))
        except BaseException as exc:  # noqa: BLE001 (any failure of a user's tool is that call's error)
            from rlctl.usercode import error_text as located

            # a setup's error names the line of the user's file that raised it; a call's, as a tool shows it
            text = located(exc) if request[0] != "call" else error_text(exc)
            reply = ("error", (type(exc).__name__, text))
        try:
            write_frame(proto_out, reply)
        except Exception as exc:  # noqa: BLE001 (a value that does not pickle)
            write_frame(proto_out, ("error", (type(exc).__name__, f"its result could not be sent back: {exc}")))
