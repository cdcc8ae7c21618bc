"""DAPO's dynamic sampling in a step (``algo.dynamic_sampling``; the rule: :mod:`rlctl.algos.filtering`).

A round is one ordinary rollout of the next prompts of the sampler's stream, scored: the first round a
whole batch (``train.batch_size``), a later one about the prompts still missing (the shortfall over the
share of varied groups so far, x1.25: :func:`rlctl.algos.filtering.next_round_size`), where verl draws a
whole generation batch each time and discards the varied groups beyond the batch. After each round every
rank sends ``(round, position, varied)`` of its groups to all (a group never crosses ranks), so all ranks
see the same list and take the same decision: stop when the varied groups fill the batch, or when
``algo.dynamic_max_rounds`` rounds ran (the batch is then topped up with non-varied groups). Each rank
keeps the picked groups it generated, renumbered by their place in the batch (``uid = place * n + j``):
the rest of the step (advantages on the global batch, mini-batches, global denominators) is unchanged.
The trainer's data position (examples drawn from the stream, saved in the checkpoint) moves by what the
rounds drew, so a resume continues from the same prompts.

The step's reward and length metrics are over every sample generated (all rounds): the reward per
generated sample. ``dynamic/*`` say what the rounds gave.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlctl.algos.filtering import GroupPick, next_round_size, pick_groups, varied_groups
from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.recipes.rl.metrics import Metrics
from rlctl.recipes.rl.stream import PromptStream
from rlctl.runtime.dist import all_gather_objects

SUMMED = {"tokens", "reward/failed", "reward/nonfinite", "reward/errors", "tool/calls", "tool/errors"}
SUMMED |= {"tool/timeouts", "tool/malformed"}
# a standard deviation over the samples -> its mean: the rounds' pool as (std^2 + mean^2) weighted by samples
POOLED = {"reward/std": "reward/mean", "response_len/std": "response_len/mean"}


def local_groups(batch: RolloutBatch) -> list[tuple[int, bool]]:
    """``(position, varied)`` of each group this rank holds (all ``n`` samples of a prompt are on one rank)."""
    n = batch.n
    order = torch.argsort(batch.uid)
    varied = varied_groups(batch.scores[order], n)
    positions = (batch.uid[order][::n] // n).tolist()
    return list(zip(positions, varied.tolist()))


def assemble(rounds: list[RolloutBatch], pick: GroupPick, mini_batch_size: int) -> RolloutBatch:
    """This rank's samples of the picked groups, renumbered by their place in the batch."""
    place = {key: k for k, key in enumerate(pick.picked)}
    n = rounds[0].n
    pieces = []
    for r, b in enumerate(rounds):
        rows, uid = [], []
        for i, u in enumerate(b.uid.tolist()):
            k = place.get((r, u // n))
            if k is not None:
                rows.append(i)
                uid.append(k * n + u % n)
        piece = b.take(rows)
        piece.uid = torch.tensor(uid, dtype=torch.int64, device=b.uid.device)
        pieces.append(piece)
    out = RolloutBatch.join(pieces)
    size = len(pick.picked)
    m = min(mini_batch_size, size) or size
    out.mini = out.uid // n // m
    out.num_minis = math.ceil(size / m)
    out.total = size * n
    return out


def combine_rounds(parts: list[Metrics], counts: list[float]) -> Metrics:
    """One step's metrics from those of its rounds (``counts``: samples per round, over all ranks):
    seconds, token and error counts add up, ``response_len/max`` is the largest, a standard deviation
    (``reward/std``, ``response_len/std``) pools with its mean (:data:`POOLED`), a key every round has is
    otherwise the sample-weighted mean (a key some round lacks, such as ``acc`` where a round's scores are
    not all 0 or 1, is left out); a text (a warning) is the last one's."""
    total = max(1.0, sum(counts))
    out: Metrics = {}
    for key in {k for p in parts for k in p}:
        values = [p[key] for p in parts if key in p]
        if isinstance(values[-1], str):
            out[key] = values[-1]
        elif key.startswith("time/") or key in SUMMED:
            out[key] = sum(values)
        elif key == "response_len/max":
            out[key] = max(values)
        elif len(values) == len(parts) and key not in POOLED:
            out[key] = sum(v * c for v, c in zip(values, counts)) / total
    for std, mean in POOLED.items():
        if all(std in p and mean in p for p in parts):
            second = sum((p[std] ** 2 + p[mean] ** 2) * c for p, c in zip(parts, counts)) / total
            out[std] = math.sqrt(max(0.0, second - out[mean] ** 2))
    return out


def dynamic_sample(
    one_round: Callable[[list[int], int], tuple[RolloutBatch, Metrics]],
    stream: PromptStream,
    *,
    n: int,
    max_rounds: int,
    step: int,
    log: Callable[[str], None],
) -> tuple[RolloutBatch, Metrics]:
    """Rounds of rollout and scoring until the varied groups fill the batch (collective); the batch and
    the step's metrics (:func:`combine_rounds` of the rounds, plus ``dynamic/*``). ``one_round(indices,
    draw)``: this rank's samples of the prompts ``indices``, scored, and their metrics (``draw``, the
    stream position, seeds the sampling); ``stream``: where the rounds draw from (it moves past them)."""
    target = stream.batch_size
    rounds: list[RolloutBatch] = []
    parts: list[Metrics] = []
    counts: list[float] = []
    seen: list[tuple[int, int, bool]] = []
    pick = None
    while pick is None:
        r = len(rounds)
        varied = sum(v for _, _, v in seen)
        size = target if not r else next_round_size(target - varied, varied, len(seen), target)
        batch, metrics = one_round(*stream.draw(size))
        parts.append(metrics)
        counts.append(float(size * n))
        rounds.append(batch)
        mine = [(r, p, v) for p, v in local_groups(batch)]
        seen += [g for part in all_gather_objects(mine) for g in part]
        pick = pick_groups(seen, target, final=r + 1 >= max_rounds)
    m = combine_rounds(parts, counts)
    m.update(
        {
            "dynamic/rounds": float(len(rounds)),
            "dynamic/kept_groups": float(pick.kept),
            "dynamic/dropped_groups": float(pick.dropped),
            "dynamic/padded_groups": float(pick.padded),
            "dynamic/surplus_groups": float(pick.surplus),
            "dynamic/generated_samples": sum(counts),
            "dynamic/extra_samples": float(sum(counts[1:])),
        }
    )
    if pick.padded:
        log(
            f"step {step + 1}: dynamic sampling ran {len(rounds)} rounds (algo.dynamic_max_rounds) and found "
            f"{pick.kept} of {target} prompts whose samples score differently; {pick.padded} all-equal groups "
            f"fill the batch"
        )
    return assemble(rounds, pick, stream.mini_batch_size), m
