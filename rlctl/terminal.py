"""Untrusted text on the operator's terminal, made inert.

A tool's result (a web page a search tool returns), a sampled response, a user's exception message or a
file name can hold bytes a terminal obeys: ESC starts an ANSI/OSC sequence (recolour, retitle the
window, write the clipboard, a hyperlink), BEL rings, NUL and the other C0/C1 control characters move
the cursor or are swallowed, and Unicode's bidirectional overrides reorder what is shown. :func:`inert`
writes each such character as a visible escape (``\\x1b``, ``\\u202e``), so the text reads as it is and
the terminal does nothing. Newlines and tabs stay unless ``keep_newlines`` is false. No imports beyond
the standard library: the CLI uses it everywhere it prints what it did not write itself.
"""

from __future__ import annotations

import re

# C0 controls but tab and newline, DEL, C1 controls, and the bidirectional formatting characters
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_ONE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def inert(text: object, *, keep_newlines: bool = True) -> str:
    """``text`` with every character a terminal would act on written as a visible escape."""
    return (_UNSAFE if keep_newlines else _UNSAFE_ONE_LINE).sub(_visible, str(text))
