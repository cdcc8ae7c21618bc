"""Micro-batches of preference units (:class:`rlctl.data.preference.Unit`): whole units each (a pair's two
sequences, or one KTO row), packed in one row with per-document positions (each document attends only to
itself) or padded one sequence per row, dealt over the data-parallel replicas as sft's are
(:mod:`rlctl.data.packing`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from rlctl.data.packing import MicroBatch, collate_packed, collate_padded, dummy_micro_batch, group_micro_batches
from rlctl.data.preference import Unit


@dataclasses.dataclass
class UnitMicroBatch(MicroBatch):
    """A micro-batch of whole units: ``seq_of_token`` [B*T] says which of its sequences (0..S-1, in unit
    order: a pair's chosen then rejected) each flat position belongs to (-1: padding), ``seq_len`` [S] the
    loss tokens of each, ``last_pos`` [S] the flat position of each one's last non-pad token; ``units``: the
    indices (into the step's batch) of its units."""

    seq_of_token: torch.Tensor | None = None
    seq_len: torch.Tensor | None = None
    last_pos: torch.Tensor | None = None
    units: list[int] = dataclasses.field(default_factory=list)


def score_position(ids: np.ndarray, pad_id: int) -> int:
    """Where a sequence's score is read: its last token that is not padding (Hugging Face's rule)."""
    keep = np.flatnonzero(np.asarray(ids) != pad_id)
    return int(keep[-1]) if keep.size else len(ids) - 1


def collate_units(units: Sequence[Unit], which: Sequence[int], *, packing: bool, pad_id: int) -> UnitMicroBatch:
    seqs = [s for u in units for s in u.seqs]
    mb = collate_packed(seqs) if packing else collate_padded(seqs, pad_id)
    width = mb.input_ids.shape[1]
    seq_of, last = torch.full((mb.input_ids.numel(),), -1, dtype=torch.long), []
    start = 0
    for k, s in enumerate(seqs):
        base = start if packing else k * width
        seq_of[base : base + len(s)] = k
        last.append(base + score_position(s.input_ids, pad_id))
        start += len(s)
    lengths = torch.tensor([s.num_loss_tokens for s in seqs], dtype=torch.float32)
    fields = {f.name: getattr(mb, f.name) for f in dataclasses.fields(MicroBatch)}
    return UnitMicroBatch(
        **fields, seq_of_token=seq_of, seq_len=lengths, last_pos=torch.tensor(last), units=list(which)
    )


def unit_micro_batches(
    units: Sequence[Unit], rank: int, world: int, *, packing: bool, budget: int, pad_id: int, per_micro: int
) -> list[MicroBatch]:
    """This rank's micro-batches of ``units`` (a step's batch): whole units each, ``ceil(groups / world)`` on
    every rank (dummies where a rank is short: FSDP's collectives need the same count)."""
    groups = group_micro_batches([len(u) for u in units], packing=packing, budget=budget, micro_batch_size=per_micro)
    out: list[MicroBatch] = []
    for k in range(max(1, math.ceil(len(groups) / world))):
        g = k * world + rank
        if g < len(groups):
            out.append(collate_units([units[i] for i in groups[g]], groups[g], packing=packing, pad_id=pad_id))
        else:
            out.append(dummy_micro_batch(pad_id))
    return out
