"""The learning-rate schedule every engine steps by: linear warmup, then a cosine down to a floor."""

from __future__ import annotations

import math


def lr_factor(step: int, total_steps: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based).

    Linear warmup over ``w = int(warmup_ratio * total_steps)`` steps ((step+1)/w), then a cosine
    from 1 at step w down towards ``min_lr_ratio`` at step ``total_steps``.
    """
    warmup = int(warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
