"""Errors meant for the user.

Anything raised as :class:`UserError` is printed by the CLI as one line (``error: ...``) and the
process exits with code 2, without a traceback. The message names the problem and the fix.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2."""

    exit_code = 2


def did_you_mean(word: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ' (did you mean X?)' or '' when nothing is close."""
    choices = list(choices)
    lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(lower), n=n, cutoff=0.5)
    if not close:
        return ""
    names = ", ".join(lower[c] for c in close)
    return f" (did you mean {names}?)"


def name_hint(word: str, names: Iterable[str], *, shown: int = 8) -> str:
    """' (did you mean X?)' when a name is close, else what exists: ' (it has: a, b, c)' or ' (it has none)'."""
    names = sorted(set(names))
    close = did_you_mean(word, names)
    if close:
        return close
    if not names:
        return " (it has none)"
    return f" (it has: {', '.join(names[:shown])}{', ...' if len(names) > shown else ''})"


def one_line(text: object) -> str:
    """``text`` on one line: every run of whitespace, newlines included, becomes one space."""
    return " ".join(str(text).split())


# What to do about an OS error, by errno name (the one place that turns OS errors into a line).
_OS_FIXES = {
    "ENOSPC": "free some space there or choose another place",
    "EDQUOT": "free some space there (disk quota) or choose another place",
    "EROFS": "choose a place on a writable file system",
    "EACCES": "choose a place you can write, or fix its permissions",
    "EPERM": "choose a place you can write, or fix its permissions",
    "EEXIST": "remove it or choose another name",
    "ENOTDIR": "a part of the path is a file, not a directory: choose another path",
    "EISDIR": "it is a directory: name a file",
    "ENOENT": "check the path",
    "ENAMETOOLONG": "choose a shorter path",
}


def os_error_text(e: OSError) -> str:
    """An OS error as one phrase: ``No space left on device: /runs/a/x``."""
    what = e.strerror or str(e) or type(e).__name__
    name = e.filename if e.filename is not None else ""
    return f"{what}: {name}" if name else what


def os_error_line(e: OSError, doing: str = "") -> str:
    """An OS error as the one line the CLI prints: what failed, on which path, and what to do."""
    import errno as errno_names

    fix = _OS_FIXES.get(errno_names.errorcode.get(e.errno or -1, ""), "")
    head = f"{doing}: " if doing else ""
    return one_line(f"{head}{os_error_text(e)}" + (f"; {fix}" if fix else ""))
