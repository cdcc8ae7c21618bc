"""Micro-batches of preference units (:class:`rlctl.data.preference.Unit`): whole units each (a pair's two
sequences, or one KTO row), packed in one row with per-document positions (each document attends only to
itself) or padded one sequence per row, dealt over the data-parallel replicas as sft's are
(:mod:`rlctl.data.packing`).

Packed with ``share_prompt`` (an engine that runs shared-prefix blocks, :mod:`rlctl.engines.varlen`), a unit's
sequences that open with the same prompt hold it once: the prompt (bar its last token, whose logit predicts
each sequence's own first response token) is a document of its own, then each sequence's rest at the
positions it has alone, attending to that prompt and causally to itself. Every response token sees exactly
the keys it sees alone, so its log-prob is the same (the prompt's gradient is the sum of both sequences');
the prompt's tokens are computed once, not once per sequence. The tokens after a sequence's last labelled
position (:func:`answer_end`) are left out: they change no log-prob.

With ``keep_labelled`` (dpo's log-probs), a micro-batch's ``keep_cols`` are the columns that carry a label
(:func:`rlctl.data.packing.labelled_columns`, as for sft): the engine computes the LM head (and the loss its
log-softmax) there only, as for an RL micro-batch (``logits_to_keep``); the prompt's positions, bar the last,
run no head."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from rlctl.data.packing import (
    MicroBatch,
    collate_packed,
    collate_padded,
    dummy_micro_batch,
    group_micro_batches,
    labelled_columns,
)
from rlctl.data.preference import Unit
from rlctl.data.sft import IGNORE, Example


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


def shared_prompt(seqs: Sequence[Example]) -> int:
    """How many leading tokens ``seqs`` (two or more) can hold once: their common prefix without a label,
    leaving each sequence at least one token of its own (0: nothing to share)."""
    if len(seqs) < 2 or any(s.pixel_values is not None for s in seqs):
        return 0
    n = min(len(s) for s in seqs) - 1
    first = seqs[0]
    same = np.ones(max(n, 0), dtype=bool)
    for s in seqs:
        same &= (s.input_ids[:n] == first.input_ids[:n]) & (s.labels[:n] == IGNORE)
    return int(np.cumprod(same).sum())  # the leading run


def answer_end(s: Example) -> int:
    """One past a sequence's last labelled position: the tokens after it (the chat template's closing newline)
    predict nothing and no earlier token attends to them, so a forward may leave them out (0: no label)."""
    labelled = np.flatnonzero(s.labels != IGNORE)
    return int(labelled[-1]) + 1 if labelled.size else 0


def collate_shared(units: Sequence[Unit], which: Sequence[int], pad_id: int) -> UnitMicroBatch:
    """One packed row of ``units``, each unit's shared prompt once (module docstring), with the ``blocks``
    (:data:`rlctl.engines.varlen.Block`) that say what attends to what."""
    ids, labels, pos, seq_of, blocks, last = [], [], [], [], [], []

    def put(tokens: np.ndarray, targets: np.ndarray, first: int, seq: int, prefix: tuple[int, int]) -> int:
        at = sum(len(x) for x in ids)
        ids.append(tokens), labels.append(targets), pos.append(np.arange(first, first + len(tokens)))
        seq_of.append(np.full(len(tokens), seq))
        blocks.append((0, at, at + len(tokens), *prefix))
        return at

    seqs = [s for u in units for s in u.seqs]
    k = 0
    for u in units:
        p, at = shared_prompt(u.seqs), sum(len(x) for x in ids)
        if p:  # the prompt: a document of its own, in no sequence's sum (no labels)
            put(u.seqs[0].input_ids[:p], u.seqs[0].labels[:p], 0, -1, (at, at))
        for s in u.seqs:
            end = max(p + 1, answer_end(s) or len(s))
            own = put(s.input_ids[p:end], s.labels[p:end], p, k, (at, at + p))
            score = min(score_position(s.input_ids, pad_id), end - 1)
            last.append(own + score - p if score >= p else at + score)
            k += 1

    def row(parts: list[np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts).astype(np.int64))[None]

    lengths = torch.tensor([s.num_loss_tokens for s in seqs], dtype=torch.float32)
    return UnitMicroBatch(
        row(ids), row(pos), row(labels), None, len(seqs), blocks=blocks, seq_of_token=row(seq_of)[0],
        seq_len=lengths, last_pos=torch.tensor(last), units=list(which),
    )  # fmt: skip


def collate_units(
    units: Sequence[Unit],
    which: Sequence[int],
    *,
    packing: bool,
    pad_id: int,
    share_prompt: bool = False,
    keep_labelled: bool = False,
) -> UnitMicroBatch:
    mb = _collate(units, which, packing=packing, pad_id=pad_id, share_prompt=share_prompt)
    if keep_labelled:
        mb.keep_cols = labelled_columns(mb.labels)
    return mb


def _collate(units: Sequence[Unit], which: Sequence[int], *, packing: bool, pad_id: int, share_prompt: bool):
    if packing and share_prompt:
        return collate_shared(units, which, pad_id)
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
    units: Sequence[Unit],
    rank: int,
    world: int,
    *,
    packing: bool,
    budget: int,
    pad_id: int,
    per_micro: int,
    share_prompt: bool = False,
    keep_labelled: bool = False,
) -> list[MicroBatch]:
    """This rank's micro-batches of ``units`` (a step's batch): whole units each, ``ceil(groups / world)`` on
    every rank (dummies where a rank is short: FSDP's collectives need the same count); ``share_prompt``: each
    unit's prompt once where packed (:func:`collate_shared`); ``keep_labelled``: the logits at the labelled
    columns only (:func:`labelled_columns`)."""
    groups = group_micro_batches([len(u) for u in units], packing=packing, budget=budget, micro_batch_size=per_micro)
    out: list[MicroBatch] = []
    for k in range(max(1, math.ceil(len(groups) / world))):
        g = k * world + rank
        if g < len(groups):
            out.append(
                collate_units(
                    [units[i] for i in groups[g]],
                    groups[g],
                    packing=packing,
                    pad_id=pad_id,
                    share_prompt=share_prompt,
                    keep_labelled=keep_labelled,
                )  # fmt: skip
            )
        else:
            out.append(dummy_micro_batch(pad_id))
    return out
