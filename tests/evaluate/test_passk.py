"""pass@k: the unbiased estimator against hand computations and a brute-force count of k-subsets."""

from __future__ import annotations

from itertools import combinations

import pytest

from rlctl.errors import UserError
from rlctl.evaluate.passk import mean_pass_at_k, pass_at_k


def _brute(n: int, c: int, k: int) -> float:
    """The share of the k-subsets of n samples (the first c correct) that hold a correct one."""
    subsets = list(combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # k=1: the share of correct samples
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k(5, 2, 4) == 1.0  # only 3 wrong samples: any 4 hold a correct one
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 4, 1) == 1.0


@pytest.mark.parametrize("n", [1, 3, 6])
def test_pass_at_k_equals_subset_count(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute(n, c, k)), (n, c, k)


def test_mean_over_prompts_and_bad_arguments():
    assert mean_pass_at_k([0, 2, 4], 4, 2) == pytest.approx((0 + (1 - 1 / 6) + 1) / 3)
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0)]:
        with pytest.raises(UserError, match="pass@k needs"):
            pass_at_k(n, c, k)


def test_inert_text():
    from rlctl.terminal import inert

    raw = "ok\x1b]0;title\x07 \x1b[31mred\x9b2J\r\nnext\ttab"
    shown = inert(raw)
    assert not any(ord(ch) < 32 and ch not in "\n\t" or 0x7F <= ord(ch) <= 0x9F for ch in shown)
    assert shown == "ok\\x1b]0;title\\x07 \\x1b[31mred\\x9b2J\\x0d\nnext\ttab"
