"""A reward worker process: :func:`main` (started by :class:`~rlctl.rewards.pool.RewardPool`).

It reads tasks ``(spec, kind, args)`` from stdin and writes ``(ok, result or error text)`` to the
stdout it was started with, one pickled frame each (4-byte length first). Whatever the reward
function prints goes to stderr, so it cannot break the protocol.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import struct
import sys
from typing import Any, BinaryIO

_HEADER = struct.Struct("<I")


def write_frame(out: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def read_frame(inp: BinaryIO) -> Any:
    head = inp.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError("reward worker pipe closed")
    (size,) = _HEADER.unpack(head)
    data = inp.read(size)
    if len(data) < size:
        raise EOFError("reward worker pipe closed")
    return pickle.loads(data)


def stop_worker(proc) -> None:
    """Kill a worker process (a ``subprocess.Popen`` speaking these frames), reap it and close its pipes."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass


def error_text(exc: BaseException) -> str:
    """``"Type: message (file.py:LINE)"``: the failure of a reward call, with the line of the reward's
    own code that raised it (the innermost frame outside rlctl, the standard library and site-packages)."""
    import traceback

    text = f"{type(exc).__name__}: {exc}"
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the rlctl package
    libs = {os.path.dirname(os.__file__), *(p for p in sys.path if p.endswith("-packages"))}
    user = [f for f in frames if not f.filename.startswith(ours) and not any(f.filename.startswith(d) for d in libs)]
    frame = (user or frames or [None])[-1]
    return f"{text} ({frame.filename}:{frame.lineno})" if frame is not None else text


def call(spec: str, kind: str, args: Any, cache: dict) -> Any:
    """Run one reward call, by keyword as the peer calls it: ``sample`` args are (data_source, solution_str,
    ground_truth, extra_info), passed as verl's naive reward manager does (``data_source=...``); ``batch``
    (verl's lists) and ``trl`` (TRL's ``prompts=, completions=, completion_ids=`` and the row's columns) args
    are the keyword dict itself."""
    from rlctl.rewards.loader import get_reward
    from rlctl.rewards.spec import SAMPLE_KEYWORDS

    fn = cache.get(spec)
    if fn is None:
        fn = cache[spec] = get_reward(spec)
    result = fn(**dict(zip(SAMPLE_KEYWORDS, args))) if kind == "sample" else fn(**args)
    if inspect.isawaitable(result):  # an async reward (TRL allows them): run to its end here
        result = asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


def main() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the trainer, which closes our stdin
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward function's prints go to stderr
    sys.stdout = sys.stderr
    inp = sys.stdin.buffer
    cache: dict = {}
    import rlctl.rewards.loader  # noqa: F401 (imported before "ready": a call's timeout excludes start-up)

    write_frame(proto_out, "ready")
    while True:
        try:
            spec, kind, args = read_frame(inp)
        except EOFError:
            return
        try:
            reply = (True, call(spec, kind, args, cache))
            data = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # noqa: BLE001 (any failure of a user's function is that sample's error)
            data = pickle.dumps((False, error_text(exc)), protocol=pickle.HIGHEST_PROTOCOL)
        proto_out.write(_HEADER.pack(len(data)) + data)
        proto_out.flush()


if __name__ == "__main__":
    main()
