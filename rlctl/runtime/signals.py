"""Stop requests that arrive before the recipe is ready to act on them (no torch here).

A rank started as ``python -m rlctl.recipes.<method>`` imports torch, transformers and the engines
before :class:`rlctl.runtime.entry.StopRequest` exists; a Ctrl-C in those seconds would otherwise
be a KeyboardInterrupt in the middle of an import. :func:`install_early` (called by
``rlctl/recipes/__init__.py`` when run that way) turns it into a flag that ``StopRequest`` takes over.
"""

from __future__ import annotations

import signal

_early = {"requested": False, "installed": False}


def _handle(signum, frame) -> None:
    if _early["requested"]:  # a second signal: stop at once
        signal.signal(signum, signal.SIG_DFL)
        raise KeyboardInterrupt
    _early["requested"] = True


def install_early() -> None:
    """Make SIGINT/SIGTERM set a flag from now on (until :class:`StopRequest` installs its own)."""
    if not _early["installed"]:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _handle)
        _early["installed"] = True


def requested_early() -> bool:
    """Whether a stop was requested before :class:`StopRequest` existed."""
    return _early["requested"]


def note_stop() -> None:
    """Record a stop request (:class:`rlctl.runtime.entry.StopRequest` calls it on a signal)."""
    _early["requested"] = True


def stop_requested() -> bool:
    """Whether this process was asked to stop (read by work that can take long, e.g. reward calls)."""
    return _early["requested"]
