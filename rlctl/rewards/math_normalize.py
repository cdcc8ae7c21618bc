r"""Answer extraction and string normalisation for math answers (MATH-style LaTeX).

- :func:`last_boxed`: the content of the last ``\boxed{...}`` / ``\fbox{...}`` (balanced braces).
- :func:`normalize_answer`: a canonical string (after Hendrycks et al.'s MATH ``strip_string``).
- :func:`is_equiv`: equal normalised strings, or both numbers (decimals, integers, simple
  fractions) with the same value.
"""

from __future__ import annotations

import math
import re

__all__ = ["is_equiv", "last_boxed", "normalize_answer", "to_number"]

_BOX = re.compile(r"\\(?:boxed|fbox)(?![a-zA-Z])")


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` or ``\fbox{...}``; ``\boxed 5`` gives ``5``.

    Braces are matched, so ``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``. None when there is no
    box or the last one is not closed (e.g. a truncated response).
    """
    matches = list(_BOX.finditer(text))
    if not matches:
        return None
    pos = matches[-1].end()
    rest = text[pos:]
    body = rest.lstrip()
    if not body.startswith("{"):
        bare = re.match(r"\s+([^\s$]+)", rest)
        return bare.group(1) if bare else None
    start = pos + len(rest) - len(body)
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


_SPACING = re.compile(r"\\[!,;: ]")  # \! \, \; \: and "\ " are only spacing
_UNIT_SUFFIX = re.compile(r"\\(?:text|mbox)\{\s+[^{}]*\}\s*$")  # "5 \text{ cm}" (MATH's unit style)
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf)\{([^{}]*)\}")
_THOUSANDS = re.compile(r"-?\d{1,3}(,\d{3})+(\.\d+)?")
_DECIMAL = re.compile(r"-?\d*\.\d+")


def normalize_answer(answer: str) -> str:
    r"""A canonical form of a math answer string.

    Drops ``$``, spacing commands (``\!``, ``\,``...), ``\left``/``\right``, degree marks, percent
    signs, a trailing unit written ``\text{ cm}``, a short ``x =`` prefix and all spaces; unwraps
    ``\text{...}``; ``\dfrac``/``\tfrac`` become ``\frac``; ``\frac12`` becomes ``\frac{1}{2}``,
    ``\sqrt3`` ``\sqrt{3}``, ``1/2`` ``\frac{1}{2}``; ``1,000`` becomes ``1000``; ``.5`` becomes
    ``0.5`` and trailing decimal zeros go (``2.50`` -> ``2.5``, ``3.0`` -> ``3``).
    """
    s = answer.strip().replace("\n", "")
    s = s.replace("\\\\", "\\")
    s = _SPACING.sub("", s)
    s = s.replace("{,}", ",")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\%", "").replace("%", "")
    s = _UNIT_SUFFIX.sub("", s)
    s = _TEXT_WRAP.sub(r"\1", s)
    if s.count("=") == 1 and len(s.split("=")[0].strip()) <= 2:
        s = s.split("=")[1]
    s = s.replace(" ", "")
    s = re.sub(r"\\sqrt([^{\[\\])", r"\\sqrt{\1}", s)
    s = re.sub(r"\\frac([0-9a-zA-Z])([0-9a-zA-Z])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac([0-9a-zA-Z])\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}([0-9a-zA-Z])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"^(-?\d+)/(\d+)$", r"\\frac{\1}{\2}", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if s.startswith("."):
        s = "0" + s
    s = s.replace("{.", "{0.")
    if _DECIMAL.fullmatch(s):
        s = s.rstrip("0").rstrip(".")
        s = "0" if s in ("", "-") else s
    return s


_NUM = r"-?\d+(?:\.\d+)?"
_FRAC = re.compile(rf"(-?)\\frac\{{({_NUM})\}}\{{({_NUM})\}}")


def to_number(normalized: str) -> float | None:
    r"""The value of a normalised answer that is a plain number or ``\frac{a}{b}``, else None."""
    if re.fullmatch(_NUM, normalized):
        return float(normalized)
    frac = _FRAC.fullmatch(normalized)
    if frac is None or float(frac.group(3)) == 0:
        return None
    value = float(frac.group(2)) / float(frac.group(3))
    return -value if frac.group(1) else value


def is_equiv(prediction: str, reference: str) -> bool:
    """Whether two answers are the same after normalisation, or are numbers of equal value."""
    a, b = normalize_answer(prediction), normalize_answer(reference)
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    return x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
