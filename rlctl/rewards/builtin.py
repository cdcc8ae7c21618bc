r"""Built-in reward functions, each with verl's signature.

``fn(data_source, solution_str, ground_truth, extra_info=None) -> float``: ``solution_str`` is
the decoded response only; ``ground_truth`` comes from the row's ``reward_model.ground_truth``;
``extra_info`` is the row's ``extra_info`` dict (may be None). Rules: ``docs/rewards.md``.
"""

from __future__ import annotations

import functools
import re
import threading
from types import ModuleType
from typing import Any

from rlctl.rewards.math_normalize import is_equiv, last_boxed

__all__ = [
    "BUILTINS",
    "exact_score",
    "extract_gsm8k_answer",
    "format_score",
    "gsm8k_flexible_score",
    "gsm8k_score",
    "length_score",
    "math_score",
]

# ---------------------------------------------------------------------------- GSM8K

GSM8K_CLIP_CHARS = 300
_GSM8K_STRICT = re.compile(r"#### \$?(-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"-?[0-9.,]*[0-9][0-9.,]*")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").strip().rstrip(".")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The final number of a GSM8K response, cleaned (no commas, ``$`` or trailing dot).

    Only the last 300 characters are read. ``strict``: the number after the last ``#### ``;
    ``flexible``: the last number anywhere in them. None when there is none.
    """
    tail = solution_str[-GSM8K_CLIP_CHARS:]
    if method == "strict":
        found = _GSM8K_STRICT.findall(tail)
    elif method == "flexible":
        found = _ANY_NUMBER.findall(tail)
    else:
        raise ValueError(f"unknown GSM8K extraction method {method!r}; choose strict or flexible")
    return _clean_number(found[-1]) if found else None


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the number after the last ``#### `` equals the ground truth (as strings), else 0.0."""
    answer = extract_gsm8k_answer(solution_str, "strict")
    return float(answer is not None and answer == _clean_number(str(ground_truth)))


def gsm8k_flexible_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> float:
    """Like :func:`gsm8k_score` but with the last number of the response (no ``####`` needed)."""
    answer = extract_gsm8k_answer(solution_str, "flexible")
    return float(answer is not None and answer == _clean_number(str(ground_truth)))


# ---------------------------------------------------------------------------- MATH


@functools.lru_cache(maxsize=1)
def _math_verify() -> ModuleType | None:
    """The optional ``math_verify`` library, imported on first use; None when it is not installed."""
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def _math_verify_equal(prediction: str, reference: str) -> bool:
    """math_verify's verdict on two boxed answers; False when it is missing or fails."""
    lib = _math_verify()
    if lib is None:
        return False
    # math_verify's timeouts use SIGALRM, which only works in the main thread
    in_main = threading.current_thread() is threading.main_thread()
    parse_kw: dict[str, Any] = {} if in_main else {"parsing_timeout": None}
    verify_kw: dict[str, Any] = {} if in_main else {"timeout_seconds": None}
    try:
        gold = lib.parse("\\boxed{" + reference + "}", **parse_kw)
        pred = lib.parse("\\boxed{" + prediction + "}", **parse_kw)
        return bool(lib.verify(gold, pred, **verify_kw))
    except Exception:  # a parser crash on odd LaTeX means "not shown equal"
        return False


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    r"""1.0 when the last ``\boxed{}`` of the response is equivalent to the ground truth, else 0.0.

    Equivalent: equal after :func:`~rlctl.rewards.math_normalize.normalize_answer`, equal as
    numbers, or (when the ``math_verify`` library is installed) equal according to it. A ground
    truth that itself contains ``\boxed{}`` is reduced to the box's content first.
    """
    prediction = last_boxed(solution_str)
    if prediction is None:
        return 0.0
    reference = str(ground_truth)
    reference = last_boxed(reference) or reference
    return float(is_equiv(prediction, reference) or _math_verify_equal(prediction, reference))


# ---------------------------------------------------------------------------- exact, format, length

_ANSWER_MARKER = re.compile(r"answer\s*:", re.IGNORECASE)


def _normalize_text(text: str) -> str:
    return " ".join(text.lower().split()).rstrip(".!?;:,").strip()


def exact_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when the response, or the text after its last ``answer:``, equals the ground truth.

    Both sides are lower-cased, whitespace-collapsed and stripped of trailing ``.!?;:,``.
    """
    target = _normalize_text(str(ground_truth))
    candidates = [solution_str]
    markers = list(_ANSWER_MARKER.finditer(solution_str))
    if markers:
        candidates.append(solution_str[markers[-1].end() :])
    return float(any(_normalize_text(c) == target for c in candidates))


DEFAULT_FORMAT_PATTERN = r"^\s*(?:<think>)?.*?</think>\s*<answer>.*?</answer>\s*$"


@functools.lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.DOTALL)


def format_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 when ``re.search(pattern, response, re.DOTALL)`` matches, else 0.0.

    ``pattern`` is ``extra_info["pattern"]`` or :data:`DEFAULT_FORMAT_PATTERN`: reasoning closed by
    ``</think>`` (the opening ``<think>`` is optional, chat templates often put it in the prompt)
    followed by ``<answer>...</answer>`` and nothing else.
    """
    pattern = (extra_info or {}).get("pattern") or DEFAULT_FORMAT_PATTERN
    return float(_compiled(pattern).search(solution_str) is not None)


DEFAULT_TARGET_LENGTH = 1024


def length_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """Shorter is better, up to a target: 1.0 up to ``target`` characters, then a linear decay
    to 0.0 at ``2 * target``. ``target`` is ``extra_info["target_length"]`` (default 1024).
    """
    target = int((extra_info or {}).get("target_length") or DEFAULT_TARGET_LENGTH)
    if target <= 0:
        raise ValueError(f"target_length must be > 0 (got {target})")
    excess = len(solution_str) - target
    return 1.0 if excess <= 0 else max(0.0, 1.0 - excess / target)


BUILTINS = {
    "gsm8k": gsm8k_score,
    "gsm8k_flexible": gsm8k_flexible_score,
    "math": math_score,
    "exact": exact_score,
    "format": format_score,
    "length": length_score,
}
