"""Model text made inert before it is printed to a terminal.

A model's output is untrusted: raw ESC / CSI / OSC sequences could move the cursor, retitle the window,
write hyperlinks or (on some terminals) worse. Every C0 / C1 control character except newline and tab
is shown as its escaped form (``\\x1b``), so the text reads the same and controls nothing.

TODO(issue 37): use the shared console sanitizer once it is on main, and drop this copy.
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def inert(text: str) -> str:
    """``text`` with every control character but ``\\n`` and ``\\t`` replaced by its escape (``\\x1b``)."""
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
