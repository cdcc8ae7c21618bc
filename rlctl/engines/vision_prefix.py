"""Shared-prefix micro-batches of a vision-language model (GRPO's group of samples of one prompt, its
images included, computed once: :func:`rlctl.recipes.rl.batch.micro_batches` with ``share_prefix``).

A shared row holds a prompt once and then each sample's response (``blocks`` say what attends to what).
Its multimodal rope positions are the ones generation used: the prompt's from the model's own
``get_rope_index`` (with the prompt's images), and each response's continuing after the prompt's largest
position, the same on the three axes (text), as the rollout engine decoded it (:mod:`rlctl.rollout.hf`) and
as a forward of the prompt and that response alone would place them.
"""

from __future__ import annotations

import torch
from torch import nn


def image_runs(types: torch.Tensor) -> int:
    """How many images a span holds: its runs of image tokens (``types`` 1 on image tokens)."""
    t = types.tolist()
    return sum(1 for j, v in enumerate(t) if v == 1 and (j == 0 or t[j - 1] == 0))


def prompt_lengths(blocks) -> dict[int, int]:
    """Each shared row's prompt length: its first block, the prompt, causal in itself (no prefix)."""
    return {row: end for row, start, end, p0, p1 in blocks if start == 0 and p1 == 0}


def shared_rope_position_ids(model: nn.Module, mb) -> torch.Tensor:
    """``[3, G, L]`` positions of the shared rows of ``mb`` (its images, in row order, in ``image_grid_thw``)."""
    image_id = model.config.image_token_id
    out = mb.position_ids[None].repeat(3, 1, 1)
    grids = list(mb.image_grid_thw) if mb.image_grid_thw is not None else []
    k = 0
    for row, length in sorted(prompt_lengths(mb.blocks).items()):
        ids = mb.input_ids[row : row + 1, :length]
        types = (ids == image_id).int()
        count = image_runs(types[0])
        if count:
            grid = torch.stack(grids[k : k + count])
            pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=types, image_grid_thw=grid)
            out[:, row, :length] = pos[:, 0]
        k += count
        shift = out[:, row, :length].max() + 1 - length  # a response's first token: the prompt's largest + 1
        out[:, row, length:] = mb.position_ids[row, length:] + shift
    if k != len(grids):
        raise ValueError(f"the shared rows hold {k} images but the micro-batch carries {len(grids)}")
    return out
