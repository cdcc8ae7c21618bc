"""Reward shaping on response lengths: DAPO's soft overlong punishment (Yu et al. 2025, eq. 13).

With ``L_max`` the generation cap and a buffer of ``L_cache`` tokens before it, a response of ``|y|``
tokens gets ``0`` when ``|y| <= L_max - L_cache``, ``((L_max - L_cache) - |y|) / L_cache`` inside the
buffer (from 0 down to -1) and ``-1`` beyond ``L_max``; times ``factor``, added to the score.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["overlong_penalty"]


def overlong_penalty(lengths: Tensor, max_len: int, buffer: int, factor: float = 1.0) -> Tensor:
    """The penalty per response (``[B]``, <= 0) for ``lengths`` tokens; ``buffer`` 0: none."""
    lengths = lengths.to(torch.float64)
    if buffer <= 0:
        return torch.zeros_like(lengths)
    if buffer > max_len:
        raise ValueError(f"overlong buffer {buffer} is longer than the generation cap {max_len}")
    start = max_len - buffer
    penalty = ((start - lengths) / buffer).clamp(min=-1.0, max=0.0)
    return factor * penalty
