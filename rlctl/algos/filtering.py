"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2; verl's ``filter_groups``): a group whose samples
all score the same has zero advantage under GRPO and teaches nothing, so it is dropped and further
prompts are sampled until the batch holds the requested number of groups.

Two pure functions: :func:`varied_groups` (which groups of a round vary) and :func:`pick_groups` (which
groups, over every round so far, make the step's batch). A group is named by ``(round, position)``:
the rollout round it came from and its prompt's position in that round's batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["GroupPick", "next_round_size", "pick_groups", "varied_groups"]

Key = tuple[int, int]  # (round, position)


def varied_groups(scores: Tensor, n: int) -> Tensor:
    """``[B / n]`` bool: for each group of ``n`` consecutive scores, whether they are not all equal
    (verl keeps a group when ``np.std(scores) > 0``; exact equality here too)."""
    if scores.numel() % n:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {n}")
    s = scores.reshape(-1, n)
    return s.amax(-1) > s.amin(-1) if s.numel() else torch.zeros(0, dtype=torch.bool)


def next_round_size(missing: int, varied: int, seen: int, full: int, *, margin: float = 1.25) -> int:
    """Prompts to draw in the next round when ``missing`` varied groups are still needed and ``varied`` of
    the ``seen`` groups so far varied: the shortfall over that share, with a ``margin`` (at least 1, at most a
    ``full`` batch; a full batch when nothing varied yet)."""
    if varied <= 0:
        return full
    return max(1, min(full, math.ceil(margin * missing * seen / varied)))


@dataclass(frozen=True)
class GroupPick:
    """The groups of one step's batch, in the batch's order, and what happened to the others."""

    picked: list[Key]  # the batch: the varied groups first (earliest first), then any padding
    kept: int  # picked groups that vary
    padded: int  # picked groups that do not vary (the rounds ran out before the batch was full)
    dropped: int  # groups that did not vary, over every round (padding included)
    surplus: int  # varied groups beyond the batch (the last round gave more than needed), discarded

    @property
    def full(self) -> bool:
        """The batch holds only varied groups."""
        return not self.padded


def pick_groups(groups: Iterable[tuple[int, int, bool]], target: int, *, final: bool) -> GroupPick | None:
    """The batch of ``target`` groups from ``groups`` (``(round, position, varied)`` of every group
    generated so far, on every rank): the first ``target`` varied groups in ``(round, position)`` order;
    None while there are fewer and another round may run (``final`` False). In the final round a
    short batch is topped up with the non-varied groups, earliest first (their GRPO advantage is 0:
    they add no gradient, and the batch keeps its size)."""
    ordered = sorted(groups)
    varied = [(r, p) for r, p, v in ordered if v]
    same = [(r, p) for r, p, v in ordered if not v]
    if len(varied) < target and not final:
        return None
    picked = varied[:target]
    pad = same[: target - len(picked)]
    return GroupPick(picked + pad, len(picked), len(pad), len(same), len(varied) - len(picked))
