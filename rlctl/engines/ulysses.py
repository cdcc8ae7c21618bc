"""Ulysses sequence parallelism for the FSDP engine (``parallel.sp``, DeepSpeed-Ulysses, arXiv 2309.14509).

The ranks form a ``(dp, sp)`` grid: the ``sp`` consecutive ranks of an SP group split each sequence
of the micro-batches they share, the ranks with the same place in their SP groups are the
data-parallel replicas. FSDP2 still shards the weights over every rank (dp x sp flattened, as verl
does): the layout of the weights, and so every checkpoint, does not depend on ``sp``.

One forward of a micro-batch ``[B, T]`` (:func:`forward`):

* each rank takes columns ``r*Tl : (r+1)*Tl`` of the rows (``Tl = ceil(T / sp)``, the last padded),
  with the positions of the whole sequence (RoPE sees the true positions);
* every decoder layer runs on the ``[B, Tl]`` shard, except attention (:func:`attention`): an
  all-to-all trades the sequence shards of q, k, v for head shards (``[B, H, Tl, d]`` ->
  ``[B, H/sp, T, d]``; KV heads repeated first where there are fewer than ``sp``), attention runs over
  the whole sequence for ``H/sp`` heads, per document or shared-prefix block
  (:mod:`rlctl.engines.varlen`: flash-attn's varlen kernel where it is installed, else sdpa), and a
  second all-to-all trades back;
* the logits are computed on the shard, at the positions the loss reads only, and stay there
  (:class:`ShardedLogits`): the per-token values the losses need (log-probs, entropy, cross-entropy)
  are computed on each rank's positions and only those ``[N]`` floats are gathered over the SP group
  (:class:`_GatherSeq`, :func:`rlctl.engines.base.response_tokens`); a critic's values ``[B, T]`` are
  gathered. The gather's backward hands each rank the gradient of its own positions, so the SP ranks'
  gradients sum to the whole micro-batch's; the engine sums gradients over all ranks.

Loss normalisation is unchanged: the recipes divide by global token counts, summed over the
data-parallel replicas (the engine's ``dp_group``), so ``sp`` 2 gives the update of ``sp`` 1.
gloo implements ``all_to_all_single``: the same code runs on CPU (tests) and on NCCL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlctl.engines import varlen

NAME = "rlctl_ulysses"


@dataclass(frozen=True)
class SPGroups:
    """This rank's place in the ``(dp, sp)`` grid and the process groups of its row and column."""

    size: int  # ranks per SP group
    rank: int  # this rank's place in its SP group
    group: dist.ProcessGroup  # the SP group: consecutive ranks that split one sequence
    dp_group: dist.ProcessGroup  # the ranks at the same place of every SP group (one per replica)
    dp_rank: int
    dp_size: int


_GROUPS: dict[tuple[str, int], SPGroups] = {}


def sp_groups(sp: int, device_type: str) -> SPGroups:
    """The groups of ``sp`` (built once per process; collective the first time). They are process groups
    of their own, never the default one, so attention's all-to-all does not queue behind FSDP2's
    all-gathers (on the default group)."""
    key = (device_type, sp)
    if key not in _GROUPS:
        world, rank = dist.get_world_size(), dist.get_rank()
        rows = [list(range(k * sp, (k + 1) * sp)) for k in range(world // sp)]
        columns = [list(range(j, world, sp)) for j in range(sp)]
        made = {tuple(ranks): dist.new_group(ranks) for ranks in rows + columns}  # every rank, in one order
        _GROUPS[key] = SPGroups(
            size=sp,
            rank=rank % sp,
            group=made[tuple(rows[rank // sp])],
            dp_group=made[tuple(columns[rank % sp])],
            dp_rank=rank // sp,
            dp_size=world // sp,
        )
    return _GROUPS[key]


# ---------------------------------------------------------------------------------------------
# Collectives with their adjoints


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` over equal chunks of dim 0; its adjoint is itself."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()  # (empty_like keeps a permuted tensor's strides; the collective writes rows in order)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, sp: int) -> torch.Tensor:
    """``[B, H, Tl, d]`` (all heads, this rank's positions) -> ``[B, H/sp, sp*Tl, d]`` (its heads, all positions)."""
    b, h, tl, d = x.shape
    chunks = x.reshape(b, sp, h // sp, tl, d).permute(1, 0, 2, 3, 4)  # chunk j: the heads rank j takes
    got = _AllToAll.apply(chunks, group)  # got[i]: my heads at rank i's positions
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * tl, d)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, sp: int) -> torch.Tensor:
    """``[B, T, H/sp, d]`` (attention's output layout) -> ``[B, T/sp, H, d]``: the inverse trade."""
    b, t, hl, d = x.shape
    chunks = x.reshape(b, sp, t // sp, hl, d).permute(1, 0, 2, 3, 4)  # chunk j: rank j's positions
    got = _AllToAll.apply(chunks, group)  # got[i]: rank i's heads at my positions
    return got.permute(1, 2, 0, 3, 4).reshape(b, t // sp, sp * hl, d)


class _GatherSeq(torch.autograd.Function):
    """Concatenate every SP rank's piece along dim 1 (pieces of ``sizes[i]`` columns); the backward
    keeps this rank's columns of the gradient (each rank's loss is the whole micro-batch's, and its
    gradient reaches the model through its own positions only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, rank: int, sizes: list[int]) -> torch.Tensor:
        ctx.rank, ctx.sizes = rank, sizes
        width = max(sizes)
        padded = F.pad(x, (0, 0) * (x.dim() - 2) + (0, width - x.shape[1])) if x.shape[1] < width else x
        padded = padded.contiguous()
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        return torch.cat([p[:, :n] for p, n in zip(pieces, sizes)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start = sum(ctx.sizes[: ctx.rank])
        return grad[:, start : start + ctx.sizes[ctx.rank]], None, None, None


# ---------------------------------------------------------------------------------------------
# Attention


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, rlctl_sp=None, **kwargs):
    """transformers' attention signature. Given ``rlctl_sp`` (the :class:`SPGroups`; the engine passes
    it with ``rlctl_blocks`` in full-sequence coordinates), the Ulysses trade around
    :func:`rlctl.engines.varlen.attention`; without, that attention as it is (e.g. generation)."""
    if rlctl_sp is None:
        return varlen.attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("rlctl_blocks") is None:
        raise RuntimeError("sequence-parallel attention needs the blocks of the whole sequence (rlctl_blocks)")
    g, sp = rlctl_sp.group, rlctl_sp.size
    kv = key.shape[1]
    if kv < sp:  # each KV head repeated for the ranks that hold its query heads
        key, value = key.repeat_interleave(sp // kv, dim=1), value.repeat_interleave(sp // kv, dim=1)
    q, k, v = seq_to_heads(query, g, sp), seq_to_heads(key, g, sp), seq_to_heads(value, g, sp)
    out, _ = varlen.attention(module, q, k, v, attention_mask, dropout, scaling, **kwargs)
    return heads_to_seq(out, g, sp), None


def install(config) -> None:
    """Make :func:`attention` the attention of the model built from ``config`` (its masks: sdpa's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation_internal = NAME


# ---------------------------------------------------------------------------------------------
# A micro-batch's forward


def blocks_of(mb) -> list[varlen.Block]:
    """What attends to what in ``mb``, in whole-row coordinates: its shared-prefix blocks, one block per
    right-padded row, or the documents of packed rows."""
    if mb.blocks is not None:
        return list(mb.blocks)
    if mb.attention_mask is not None:
        lengths = mb.attention_mask.sum(-1).tolist()
        if any(not bool(mb.attention_mask[r, : int(n)].all()) for r, n in enumerate(lengths)):
            raise RuntimeError("sequence parallelism takes right-padded rows only")
        return [(r, 0, int(n), 0, 0) for r, n in enumerate(lengths) if n]
    return varlen.blocks_from_positions(mb.position_ids)


@dataclass(frozen=True)
class ShardedLogits:
    """An actor's output under sp: this rank's logits at the columns it owns, of the ``K`` columns
    the loss reads (``mb.keep_cols``, ``mb.logit_index``, or every column). :meth:`per_token` computes
    per-token values (log-probs, entropy, cross-entropy) on them and gathers ``[M]`` floats over the
    SP group instead of ``[M, V]`` logits."""

    local: torch.Tensor  # [B, n, V]: the logits at the columns this rank owns, in their order
    owner: torch.Tensor  # [K] the SP rank that owns each column
    local_col: torch.Tensor  # [K] the column's place among its owner's
    groups: SPGroups

    def sum(self) -> torch.Tensor:
        """A dummy micro-batch's zero loss (``output.sum() * 0``) reaches the whole model."""
        return self.local.sum()

    def per_token(self, flat: torch.Tensor, labels: torch.Tensor, fn) -> tuple[torch.Tensor, ...]:
        """``fn(logits [M', V], labels [M']) -> [M']`` tensor(s) (or None) at the entries ``flat`` of the ``[B, K]``
        grid (``labels`` [M] their labels): computed by each entry's owner, gathered in ``flat``'s order.
        The gather's backward hands each rank the gradient of its own entries."""
        g, k_all = self.groups, self.owner.numel()
        b, k = torch.div(flat, k_all, rounding_mode="floor"), flat % k_all
        own = self.owner[k]
        mine = own == g.rank
        rows = self.local.flatten(0, 1)[b[mine] * self.local.shape[1] + self.local_col[k[mine]]]
        outs = fn(rows, labels[mine])
        sizes = torch.bincount(own, minlength=g.size).tolist()
        back = torch.argsort(torch.argsort(own, stable=True))
        outs = outs if isinstance(outs, tuple) else (outs,)
        return tuple(None if o is None else _GatherSeq.apply(o[None], g.group, g.rank, sizes)[0][back] for o in outs)

    def full(self) -> torch.Tensor:
        """The logits ``[B, K, V]`` of every kept column, gathered (as without sp)."""
        g = self.groups
        sizes = torch.bincount(self.owner, minlength=g.size).tolist()
        gathered = _GatherSeq.apply(self.local, g.group, g.rank, sizes)  # by owner
        return gathered[:, torch.argsort(torch.argsort(self.owner, stable=True))]


def _owners(keep: torch.Tensor, local: int, sp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each kept column's owning rank, and its place among that rank's kept columns."""
    owner = torch.div(keep, local, rounding_mode="floor")
    counts = torch.bincount(owner, minlength=sp)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.argsort(torch.argsort(owner, stable=True))  # its place when sorted by owner
    return owner, place - starts[owner]


def forward(model, mb, groups: SPGroups, *, critic: bool, flash: bool = False) -> torch.Tensor | ShardedLogits:
    """The model's output for micro-batch ``mb``: an actor's :class:`ShardedLogits` at ``mb.keep_cols`` /
    ``mb.logit_index`` (every column when neither), or a critic's values ``[B, T]``, gathered. ``flash``:
    attention per document with flash-attn's varlen kernel (:func:`rlctl.engines.varlen.attention`)."""
    sp, r = groups.size, groups.rank
    length = mb.input_ids.shape[1]
    local = math.ceil(length / sp)
    pad = local * sp - length
    ids = F.pad(mb.input_ids, (0, pad)) if pad else mb.input_ids
    pos = F.pad(mb.position_ids, (0, pad)) if pad else mb.position_ids
    cols = slice(r * local, (r + 1) * local)
    kwargs = {
        "attention_mask": varlen.placeholder_mask(ids.device),
        "rlctl_blocks": blocks_of(mb),
        "rlctl_sp": groups,
        "rlctl_flash": flash,
    }
    if critic:
        values = model(ids[:, cols], position_ids=pos[:, cols], **kwargs)
        return _GatherSeq.apply(values, groups.group, r, [local] * sp)[:, :length]
    keep = mb.keep_cols if mb.keep_cols is not None else mb.logit_index
    if keep is None:
        keep = torch.arange(length, device=ids.device)
    owner, local_col = _owners(keep, local, sp)
    mine = keep[owner == r] - r * local
    logits = model(
        input_ids=ids[:, cols], position_ids=pos[:, cols], use_cache=False, logits_to_keep=mine, **kwargs
    ).logits
    return ShardedLogits(logits, owner, local_col, groups)
