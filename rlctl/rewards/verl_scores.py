"""verl's ``verl.utils.reward_score`` helpers as plain functions, for users' files that import them unchanged
(``from verl.utils.reward_score import gsm8k``; ``from verl.utils.reward_score.gsm8k import compute_score``).

Same arguments and the same results as verl's (its rules, written here by rlctl):

* ``gsm8k.compute_score(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0)``: the
  answer of the last 300 characters (``strict``: the number after the last ``#### ``, commas and ``$``
  removed; ``flexible``: the last number-like run, as found); ``score`` when it equals ``ground_truth`` as a
  string, ``format_score`` when there is an answer that differs, 0 when there is none;
* ``math_reward.compute_score(solution_str, ground_truth)`` (``math`` in verl before 0.5): 1.0 when the last
  ``\\boxed{}`` is equivalent to the ground truth (rlctl's normaliser), else 0.0;
* ``default_compute_score(data_source, solution_str, ground_truth, extra_info=None, ...)``: the two above by
  ``data_source``, as verl routes them; any other source raises NotImplementedError, as verl's does.
"""

from __future__ import annotations

import re
from typing import Any

from rlctl.rewards.math_normalize import is_equiv as _equiv
from rlctl.rewards.math_normalize import last_boxed

__all__ = [
    "default_compute_score",
    "gsm8k_compute_score",
    "gsm8k_extract_solution",
    "is_equiv",
    "last_boxed_only_string",
    "math_compute_score",
    "remove_boxed",
]

CLIP_CHARS = 300  # verl reads only the end of a GSM8K response
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_NUMBER_LIKE = re.compile(r"(\-?[0-9\.\,]+)")
GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


def gsm8k_extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """verl's ``gsm8k.extract_solution``: the answer string, or None."""
    if method not in ("strict", "flexible"):
        raise AssertionError(f"method must be 'strict' or 'flexible', got {method!r}")  # verl asserts
    tail = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    found = _NUMBER_LIKE.findall(tail)
    usable = [x for x in found if x not in ("", ".")]
    if usable:
        return usable[-1]
    return found[0] if found else None  # verl's loop ends on the first run when none is usable


def gsm8k_compute_score(
    solution_str: str, ground_truth: Any, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """verl's ``gsm8k.compute_score``."""
    answer = gsm8k_extract_solution(solution_str, method)
    if answer is None:
        return 0
    return score if answer == ground_truth else format_score


def last_boxed_only_string(string: str) -> str | None:
    """The last ``\\boxed{...}`` of ``string``, braces included, or None."""
    content = last_boxed(string)
    return None if content is None else "\\boxed{" + content + "}"


def remove_boxed(s: str) -> str:
    """``\\boxed{x}`` -> ``x``."""
    content = last_boxed(s)
    return s if content is None else content


def is_equiv(str1: Any, str2: Any, verbose: bool = False) -> bool:
    """Whether two answers are equivalent after normalisation (None and None are)."""
    if str1 is None and str2 is None:
        return True
    if str1 is None or str2 is None:
        return False
    return _equiv(str(str1), str(str2))


def math_compute_score(solution_str: str, ground_truth: Any) -> float:
    """verl's ``math_reward.compute_score``: 1.0 when the last boxed answer is equivalent, else 0.0."""
    try:
        boxed = last_boxed_only_string(solution_str)
        return 1.0 if boxed is not None and is_equiv(remove_boxed(boxed), ground_truth) else 0.0
    except Exception:  # noqa: BLE001 (verl scores a response it cannot parse 0.0)
        return 0.0


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs: Any
) -> float | dict:
    """verl's ``default_compute_score`` for the sources rlctl's stand-in covers (GSM8K and MATH)."""
    if data_source in GSM8K_SOURCES:
        res: Any = gsm8k_compute_score(solution_str, ground_truth)
    elif data_source in MATH_SOURCES:
        res = math_compute_score(solution_str, ground_truth)
    else:
        raise NotImplementedError(
            f"Reward function is not implemented for {data_source=} in rlctl's verl stand-in; install verl or use "
            "--reward"
        )
    return res if isinstance(res, dict) else float(res)
