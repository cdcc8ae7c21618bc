"""Helpers for the dpo and rm tests: a synthetic preference task the tiny tokenizer knows."""

from __future__ import annotations

import random


def format_pairs(n: int, *, seed: int = 0) -> list[dict]:
    """TRL's standard layout: the chosen answer ends with the ``#### N`` line the rejected one lacks (the
    demo's answer format), on sums the tiny tokenizer knows; a held-out split has other sums."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(0, 100, 3), rng.randrange(0, 100, 7)
        s = a + b
        rows.append(
            {
                "prompt": f"What is {a} + {b}?",
                "chosen": f"The answer is {s}. #### {s}",
                "rejected": f"The answer is {s}.",
            }
        )
    return rows
