"""The samples of one RL step on one rank: which prompts a rank takes, :class:`RolloutBatch`, and its
packing into micro-batches (:class:`rlctl.data.packing.MicroBatch`, the one micro-batch type)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

import torch

from rlctl.config import RunConfig
from rlctl.data.packing import MicroBatch, pack_bins
from rlctl.data.rl import Prompt
from rlctl.runtime.dist import all_reduce_max


def mini_batch_ranges(batch_size: int, mini_batch_size: int) -> list[range]:
    """Prompt positions of each mini-batch of a step (the last may be smaller)."""
    m = mini_batch_size or batch_size
    return [range(s, min(s + m, batch_size)) for s in range(0, batch_size, m)]


def rank_positions(batch_size: int, mini_batch_size: int, rank: int, world: int) -> list[int]:
    """Prompt positions (0..batch_size-1) this rank takes: its round-robin share of every mini-batch."""
    return [p for r in mini_batch_ranges(batch_size, mini_batch_size) for p in r if (p - r.start) % world == rank]


def sampling_params(cfg, step: int, group: int, groups: int, *, temperature: float, seed_offset: int = 0):
    """Sampling parameters with a seed of their own for each (step, rollout group ``group`` of ``groups``)."""
    from rlctl.rollout import SamplingParams

    r = cfg.rollout
    call = (step * groups + group) * 2 + seed_offset
    return SamplingParams(
        temperature=temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_tokens=r.max_response_len,
        seed=cfg.train.seed + call * 1_000_003,
    )


@dataclass
class RolloutBatch:
    """This rank's samples of one step. Per-token tensors are ``[b, width]`` (width = max response
    length), zero past each response; ``mask`` is 1 on the response tokens the policy sampled (the loss
    mask: 0 on the tool / environment / user tokens of a multi-turn trajectory, which are context only)."""

    prompts: list[list[int]]  # prompt token ids, one entry per sample
    responses: list[list[int]]  # response token ids (the stop token included when it stopped)
    uid: torch.Tensor  # [b] int64 global sample id: position * n + j
    mini: torch.Tensor  # [b] int64 mini-batch of each sample
    n: int  # samples per prompt
    num_minis: int  # mini-batches in the step (the same on every rank)
    total: int  # samples in the step over all ranks
    mask: torch.Tensor
    rollout_logp: torch.Tensor  # the rollout engine's log-probs
    truncated: torch.Tensor  # [b] bool: stopped by the length budget
    meta: list[Prompt] = field(default_factory=list)  # the prompt of each sample (reward arguments)
    trajectories: list = field(default_factory=list)  # each sample's rlctl.agents Trajectory (rl.turns)
    greedy: list = field(default_factory=list)  # needs_greedy estimators: the greedy sample of each row's prompt
    baselines: torch.Tensor | None = None  # [b] the score of greedy[i] (remax's baseline)
    reward_parts: list = field(default_factory=list)  # each sample's reward components, unweighted (samples.jsonl)
    scores: torch.Tensor | None = None  # [b]
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.responses)

    @classmethod
    def build(
        cls,
        prompts: list[list[int]],
        responses: list[list[int]],
        rollout_logp: list[list[float]],
        uid: list[int],
        *,
        n: int,
        batch_size: int,
        mini_batch_size: int,
        width: int,
        truncated: list[bool] | None = None,
        meta: list[Prompt] | None = None,
        device: torch.device | str = "cpu",
        loss_masks: list[list[int]] | None = None,
        trajectories: list | None = None,
    ) -> RolloutBatch:
        """A batch from plain lists (one entry per sample); ``batch_size`` = prompts in the step.
        ``loss_masks``: 1 per sampled token, 0 per context token (multi-turn); default all 1."""
        b = len(responses)
        for i, resp in enumerate(responses):
            if not 0 < len(resp) <= width:
                raise ValueError(f"response {i} has {len(resp)} tokens; expected 1..{width}")
            if loss_masks is not None and (len(loss_masks[i]) != len(resp) or not any(loss_masks[i])):
                raise ValueError(f"response {i}: its loss mask must cover its {len(resp)} tokens, one sampled")
        # padded rows built as lists: two tensors at once, not two small copies per sample
        pads = [width - len(r) for r in responses]
        masks = loss_masks or [[1] * len(r) for r in responses]
        mask = torch.tensor([[float(x) for x in m] + [0.0] * p for m, p in zip(masks, pads)], device=device)
        logp = torch.tensor(
            [[float(x) for x in lp] + [0.0] * p for lp, p in zip(rollout_logp, pads)],
            dtype=torch.float32,
            device=device,
        ).reshape(b, width)
        mask = mask.reshape(b, width)
        m = mini_batch_size or batch_size
        uid_t = torch.tensor(uid, dtype=torch.int64, device=device).reshape(-1)
        return cls(
            prompts=[list(p) for p in prompts],
            responses=[list(r) for r in responses],
            uid=uid_t,
            mini=uid_t // n // m,
            n=n,
            num_minis=math.ceil(batch_size / m),
            total=batch_size * n,
            mask=mask,
            rollout_logp=logp,
            truncated=torch.tensor(truncated or [False] * b, dtype=torch.bool, device=device),
            meta=list(meta or []),
            trajectories=list(trajectories or []),
        )

    @property
    def lengths(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on ``device``."""
        moved = {f.name: v.to(device) for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def take(self, rows: list[int]) -> RolloutBatch:
        """The samples ``rows`` of this batch, in that order (the step's fields unchanged)."""
        idx = torch.tensor(rows, dtype=torch.int64, device=self.mask.device)
        picked: dict = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                picked[f.name] = v[idx]
            elif isinstance(v, list) and len(v) == len(self):
                picked[f.name] = [v[i] for i in rows]
        return replace(self, **picked)

    @classmethod
    def join(cls, parts: list[RolloutBatch]) -> RolloutBatch:
        """One batch holding the samples of ``parts`` (batches of the same step), in order."""
        out = {}
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            if isinstance(values[0], list):
                out[f.name] = [x for v in values for x in v]
            elif isinstance(values[0], torch.Tensor):
                out[f.name] = torch.cat(values)
            else:  # the step's n, num_minis, total; None for what is not computed yet
                out[f.name] = values[0]
        return cls(**out)


def mask_truncated(batch: RolloutBatch) -> int:
    """DAPO's overlong filtering: zero the loss mask of the truncated samples (stopped by the length
    budget, no stop token); the update leaves such rows out. Returns how many there are."""
    cut = batch.truncated.to(batch.mask.dtype)
    batch.mask = batch.mask * (1 - cut)[:, None]
    return int(batch.truncated.sum())


# ---------------------------------------------------------------------------------------------
# Packed micro-batches


def _int64(x, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.int64).to(device)


def _response_fields(batch: RolloutBatch, rows: list[int], logit_index: list[int], device: torch.device) -> dict:
    """The :class:`MicroBatch` fields every layout shares, ``rows``' responses in order: each token's label,
    where its logit is (``logit_index``, the layout's), and its row and column in the ``[b, width]`` batch."""
    responses = [batch.responses[i] for i in rows]
    return {
        "labels": _int64([tok for resp in responses for tok in resp], device),
        "num_seqs": len(rows),
        "rows": _int64(rows, device),
        "logit_index": _int64(logit_index, device),
        "token_row": _int64([r for r, resp in enumerate(responses) for _ in resp], device),
        "token_col": _int64([c for resp in responses for c in range(len(resp))], device),
        "width": max(len(resp) for resp in responses),
    }


def _collate(batch: RolloutBatch, rows: list[int], device: torch.device) -> MicroBatch:
    ids: list[int] = []
    pos: list[int] = []
    logit_index: list[int] = []
    for i in rows:
        prompt, resp = batch.prompts[i], batch.responses[i]
        start = len(ids)
        ids += prompt + resp
        pos += range(len(prompt) + len(resp))
        # logits at position t predict token t+1
        logit_index += range(start + len(prompt) - 1, start + len(prompt) + len(resp) - 1)
    return MicroBatch(
        input_ids=_int64(ids, device)[None],
        position_ids=_int64(pos, device)[None],
        **_response_fields(batch, rows, logit_index, device),
        **prompt_images(batch, rows, device),
    )


def prompt_images(batch: RolloutBatch, rows: list[int], device: torch.device) -> dict:
    """``pixel_values`` and ``image_grid_thw`` of the prompts of ``rows`` (vision-language prompts,
    rlctl.data.rl), concatenated in row order: the same pixels the rollout engine prefilled ({} without any)."""
    prompts = [batch.meta[i] for i in rows] if batch.meta else []
    given = [p for p in prompts if getattr(p, "pixel_values", None) is not None]
    if not given:
        return {}
    return {
        "pixel_values": torch.cat([torch.as_tensor(p.pixel_values, dtype=torch.float32) for p in given]).to(device),
        "image_grid_thw": torch.cat([torch.as_tensor(p.image_grid_thw, dtype=torch.int64) for p in given]).to(device),
    }


def _dummy(pad_id: int, device: torch.device) -> MicroBatch:
    one = torch.tensor([[pad_id]], dtype=torch.int64, device=device)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return MicroBatch(
        input_ids=one,
        position_ids=torch.zeros_like(one),
        labels=empty,
        rows=empty,
        logit_index=empty,
        token_row=empty,
        token_col=empty,
    )


def _prompt_groups(batch: RolloutBatch, rows: list[int], budget: int) -> list[list[int]]:
    """``rows`` grouped by prompt (in order), a group split where its prefix plus responses exceed ``budget``.
    A prompt is its tokens and, where prompts carry images, its position in the step (``uid // n``): two
    vision-language prompts of equal tokens differ by their images. (Text batches never read ``uid``: on an
    accelerator that would be a device-to-host copy.)"""
    with_images = any(getattr(p, "pixel_values", None) is not None for p in batch.meta)
    positions = (batch.uid // batch.n).tolist() if with_images else [0] * len(batch)
    by_prompt: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i in rows:
        by_prompt.setdefault((positions[i], tuple(batch.prompts[i])), []).append(i)
    groups = []
    for (_, prompt), members in by_prompt.items():
        current, size = [], len(prompt)
        for i in members:
            if current and size + len(batch.responses[i]) - 1 > budget:
                groups.append(current)
                current, size = [], len(prompt)
            current.append(i)
            size += len(batch.responses[i]) - 1
        groups.append(current)
    return groups


def _collate_shared(batch: RolloutBatch, groups: list[list[int]], pad_id: int, device: torch.device) -> MicroBatch:
    """One row per group: its prompt once, then each sample's response (bar the last token, which predicts
    nothing) at positions P.., and the ``blocks`` (:mod:`rlctl.engines.varlen`) that say what attends to
    what: the prompt causal in itself, each response to the whole prompt and causally to itself. (No dense
    ``[G, 1, L, L]`` mask here: the engine builds one from the blocks where it runs one, ``varlen.dense_mask``.)"""
    rows = [i for g in groups for i in g]
    id_rows, pos_rows, logit_pos, blocks = [], [], [], []
    for g, members in enumerate(groups):
        prompt = batch.prompts[members[0]]
        ids, pos, wanted = list(prompt), list(range(len(prompt))), []
        blocks.append((g, 0, len(prompt), 0, 0))
        for i in members:
            resp = batch.responses[i]
            start = len(ids)
            if len(resp) > 1:
                blocks.append((g, start, start + len(resp) - 1, 0, len(prompt)))
            ids += resp[:-1]
            pos += range(len(prompt), len(prompt) + len(resp) - 1)
            wanted += [len(prompt) - 1] + list(range(start, start + len(resp) - 1))
        id_rows.append(ids)
        pos_rows.append(pos)
        logit_pos.append(wanted)
    width = max(len(r) for r in id_rows)
    keep = sorted({c for w in logit_pos for c in w})
    col_of = {c: k for k, c in enumerate(keep)}
    logit_index = [g * len(keep) + col_of[c] for g, w in enumerate(logit_pos) for c in w]
    ids = torch.full((len(groups), width), pad_id, dtype=torch.int64)
    pos = torch.zeros(len(groups), width, dtype=torch.int64)
    for g in range(len(groups)):
        n = len(id_rows[g])
        ids[g, :n] = torch.tensor(id_rows[g])
        pos[g, :n] = torch.tensor(pos_rows[g])
    return MicroBatch(
        input_ids=ids.to(device),
        position_ids=pos.to(device),
        **_response_fields(batch, rows, logit_index, device),
        keep_cols=_int64(keep, device),
        blocks=blocks,
        **prompt_images(batch, [g[0] for g in groups], device),  # a group's images once, with its prompt
    )


def can_share_prefix(batch: RolloutBatch) -> bool:
    """Shared prompts save work only with several samples per prompt."""
    return batch.n > 1


def micro_batches(
    batch: RolloutBatch,
    rows: list[int],
    *,
    budget: int,
    pad_id: int,
    device: torch.device,
    share_prefix: bool = False,
) -> list[MicroBatch]:
    """The given rows packed first-fit-decreasing into micro-batches of at most ``budget`` tokens,
    padded with dummies to the same count on every rank (collective). With ``share_prefix`` (see
    :func:`can_share_prefix`) the samples of a prompt share one copy of it: a group costs P + sum(R - 1)."""
    if share_prefix and rows:
        groups = _prompt_groups(batch, rows, budget)
        cost = [len(batch.prompts[g[0]]) + sum(len(batch.responses[i]) - 1 for i in g) for g in groups]
        bins = pack_bins(cost, max(budget, *cost))
        count = all_reduce_max(len(bins), device)
        out = [_collate_shared(batch, [groups[j] for j in sorted(b)], pad_id, device) for b in bins]
        return out + [_dummy(pad_id, device) for _ in range(count - len(bins))]
    lengths = batch.lengths
    bins = pack_bins([lengths[i] for i in rows], budget) if rows else []
    count = all_reduce_max(len(bins), device)
    out = [_collate(batch, [rows[j] for j in b], device) for b in bins]
    return out + [_dummy(pad_id, device) for _ in range(count - len(bins))]


def token_budget(cfg: RunConfig) -> int:
    """Tokens per packed micro-batch on one device: ``train.max_tokens_per_micro_batch``, else
    micro_batch_size x (max prompt + max response), and never below one full sequence."""
    seq = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    mbs = cfg.train.micro_batch_size or 1  # the plan's choice is in the resolved config
    return max(cfg.train.max_tokens_per_micro_batch or mbs * seq, seq)
