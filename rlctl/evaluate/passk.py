"""pass@k, the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code").

With ``n`` samples of a prompt of which ``c`` are correct, the probability that at least one of ``k``
samples drawn without replacement from the ``n`` is correct is ``1 - C(n-c, k) / C(n, k)``; it is 1 when
fewer than ``k`` samples are wrong (``n - c < k``). The mean over prompts estimates pass@k.
"""

from __future__ import annotations

from math import comb

from rlctl.errors import UserError

CORRECT_AT = 1.0  # a sample is correct when its reward is >= this (as training's val/pass@k counts)


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n-c, k) / C(n, k)`` for one prompt: ``n`` samples, ``c`` correct, ``k`` drawn."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise UserError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def mean_pass_at_k(correct_counts: list[int], n: int, k: int) -> float:
    """pass@k over prompts: the mean of :func:`pass_at_k` of each prompt's count of correct samples."""
    if not correct_counts:
        return 0.0
    return sum(pass_at_k(n, c, k) for c in correct_counts) / len(correct_counts)
