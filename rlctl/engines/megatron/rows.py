"""Packed rows <-> one padded row per document (megatron-core's RoPE numbers positions 0..L-1 per row)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass
class Unpacked:
    """Documents of a [B, T] batch laid out one per row, ``tokens`` [N, L] (right-padded with 0)."""

    tokens: torch.Tensor
    index: torch.Tensor  # [B*T] flat position in tokens (N*L) of each input position
    shape: tuple[int, int]

    def repack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, L, ...] -> [B, T, ...] in the input's layout (differentiable)."""
        return x.flatten(0, 1)[self.index].reshape(*self.shape, *x.shape[2:])  # (flatten: also 0 columns)


def unpack_rows(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    multiple: int = 1,
) -> Unpacked:
    """Split rows at every position-id restart (pos[t] != pos[t-1] + 1) into one row per document.

    Padding (``attention_mask`` 0) never starts a document: it stays at the end of the one before.
    ``L`` is rounded up to ``multiple`` (sequence parallelism splits it over tp).
    """
    b, t = input_ids.shape
    pos = position_ids.expand(b, t)
    starts = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if attention_mask is not None:
        starts[:, 1:] &= attention_mask[:, 1:].bool()
    flat = starts.flatten()
    segment = torch.cumsum(flat.long(), 0) - 1
    first = torch.nonzero(flat).flatten()
    offset = torch.arange(b * t, device=input_ids.device) - first[segment]
    width = int(offset.max()) + 1
    width = -(-width // multiple) * multiple
    tokens = input_ids.new_zeros(first.numel(), width)
    tokens[segment, offset] = input_ids.flatten()
    return Unpacked(tokens, segment * width + offset, (b, t))


def moved(x: Any, device: torch.device | str) -> Any:
    """Tensors (also inside lists and dicts) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: moved(v, device) for k, v in x.items()}
    if isinstance(x, list):
        return [moved(v, device) for v in x]
    return x
