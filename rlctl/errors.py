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


def one_line(text: object) -> str:
    """``text`` on one line: every run of whitespace, newlines included, becomes one space."""
    return " ".join(str(text).split())
