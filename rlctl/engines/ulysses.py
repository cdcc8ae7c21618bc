"""Ulysses sequence parallelism for the FSDP engine (``parallel.sp``, DeepSpeed-Ulysses, arXiv 2309.14509).

The ranks form a ``(dp, sp)`` grid (:class:`rlctl.engines.dims.ParallelDims`): the ``sp`` consecutive
ranks of an SP group split each sequence of the micro-batches they share, the ranks with the same place
in their SP groups are the data-parallel replicas. FSDP2 still shards the weights over every rank
(dp x sp flattened, as verl does): the layout of the weights, and so every checkpoint, does not depend on ``sp``.

One forward of a micro-batch ``[B, T]`` (:class:`UlyssesCalls`, chosen once by the engine when sp > 1):

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

from rlctl.data.packing import MicroBatch
from rlctl.engines import varlen
from rlctl.engines.dims import ParallelDims

NAME = "rlctl_ulysses"


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
    """transformers' attention signature. Given ``rlctl_sp`` (the :class:`ParallelDims`; the engine passes
    it with ``rlctl_blocks`` in full-sequence coordinates), the Ulysses trade around
    :func:`rlctl.engines.varlen.attention`; without, that attention as it is (e.g. generation)."""
    if rlctl_sp is None:
        return varlen.attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if kwargs.get("rlctl_blocks") is None:
        raise RuntimeError("sequence-parallel attention needs the blocks of the whole sequence (rlctl_blocks)")
    g, sp = rlctl_sp.sp_group, rlctl_sp.sp
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
    dims: ParallelDims

    def sum(self) -> torch.Tensor:
        """A dummy micro-batch's zero loss (``output.sum() * 0``) reaches the whole model."""
        return self.local.sum()

    def per_token(
        self, flat: torch.Tensor, labels: torch.Tensor, fn, *, paired: ShardedLogits | None = None
    ) -> tuple[torch.Tensor, ...]:
        """``fn(logits [M', V], labels [M']) -> [M']`` tensor(s) (or None) at the entries ``flat`` of the ``[B, K]``
        grid (``labels`` [M] their labels): computed by each entry's owner, gathered in ``flat``'s order.
        The gather's backward hands each rank the gradient of its own entries. With ``paired`` (another model's
        output of the same micro-batch, so the same columns on the same ranks: a distillation teacher's),
        ``fn(logits, paired_logits, labels)`` gets both models' rows of the same entries."""
        g, k_all = self.dims, self.owner.numel()
        b, k = torch.div(flat, k_all, rounding_mode="floor"), flat % k_all
        own = self.owner[k]
        mine = own == g.sp_rank
        index = b[mine] * self.local.shape[1] + self.local_col[k[mine]]
        rows = self.local.flatten(0, 1)[index]
        if paired is None:
            outs = fn(rows, labels[mine])
        else:
            if not (torch.equal(paired.owner, self.owner) and torch.equal(paired.local_col, self.local_col)):
                raise RuntimeError("the paired sequence shards own other columns than this output's")
            outs = fn(rows, paired.local.flatten(0, 1)[index], labels[mine])
        sizes = torch.bincount(own, minlength=g.sp).tolist()
        back = torch.argsort(torch.argsort(own, stable=True))
        outs = outs if isinstance(outs, tuple) else (outs,)
        return tuple(
            None if o is None else _GatherSeq.apply(o[None], g.sp_group, g.sp_rank, sizes)[0][back] for o in outs
        )

    def full(self) -> torch.Tensor:
        """The logits ``[B, K, V]`` of every kept column, gathered (as without sp)."""
        g = self.dims
        sizes = torch.bincount(self.owner, minlength=g.sp).tolist()
        gathered = _GatherSeq.apply(self.local, g.sp_group, g.sp_rank, sizes)  # by owner
        return gathered[:, torch.argsort(torch.argsort(self.owner, stable=True))]


def _owners(keep: torch.Tensor, local: int, sp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each kept column's owning rank, and its place among that rank's kept columns."""
    owner = torch.div(keep, local, rounding_mode="floor")
    counts = torch.bincount(owner, minlength=sp)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.argsort(torch.argsort(owner, stable=True))  # its place when sorted by owner
    return owner, place - starts[owner]


@dataclass(frozen=True)
class _Shard:
    """This rank's columns of a micro-batch, padded to ``sp`` equal shards, and the attention's inputs."""

    ids: torch.Tensor  # [B, Tl]
    pos: torch.Tensor  # [B, Tl]: the positions in the whole sequence
    local: int  # Tl
    length: int  # T
    kwargs: dict


def _shard(mb, dims: ParallelDims, flash: bool) -> _Shard:
    sp, r = dims.sp, dims.sp_rank
    length = mb.input_ids.shape[1]
    local = math.ceil(length / sp)
    pad = local * sp - length
    ids = F.pad(mb.input_ids, (0, pad)) if pad else mb.input_ids
    pos = F.pad(mb.position_ids, (0, pad)) if pad else mb.position_ids
    cols = slice(r * local, (r + 1) * local)
    kwargs = {
        "attention_mask": varlen.placeholder_mask(ids.device),
        "rlctl_blocks": blocks_of(mb),
        "rlctl_sp": dims,
        "rlctl_flash": flash,
    }
    return _Shard(ids[:, cols], pos[:, cols], local, length, kwargs)


def forward_values(model, mb, dims: ParallelDims, *, flash: bool = False) -> torch.Tensor:
    """A critic's values ``[B, T]`` for micro-batch ``mb``, gathered over the SP group. ``flash``: attention
    per document with flash-attn's varlen kernel (:func:`rlctl.engines.varlen.attention`)."""
    s = _shard(mb, dims, flash)
    values = model(s.ids, position_ids=s.pos, **s.kwargs)
    return _GatherSeq.apply(values, dims.sp_group, dims.sp_rank, [s.local] * dims.sp)[:, : s.length]


def forward_logits(model, mb, dims: ParallelDims, *, flash: bool = False) -> ShardedLogits:
    """An actor's :class:`ShardedLogits` for micro-batch ``mb`` at ``mb.keep_cols`` / ``mb.logit_index``
    (every column when neither)."""
    s = _shard(mb, dims, flash)
    keep = mb.keep_cols if mb.keep_cols is not None else mb.logit_index
    if keep is None:
        keep = torch.arange(s.length, device=mb.input_ids.device)
    owner, local_col = _owners(keep, s.local, dims.sp)
    mine = keep[owner == dims.sp_rank] - dims.sp_rank * s.local
    logits = model(input_ids=s.ids, position_ids=s.pos, use_cache=False, logits_to_keep=mine, **s.kwargs).logits
    return ShardedLogits(logits, owner, local_col, dims)


class UlyssesCalls:
    """How the engine calls its model when sp > 1: :func:`attention` installed, each micro-batch's sequence
    split over the SP group (the adapter's :meth:`~rlctl.engines.adapters.ModelAdapter.sp_forward`)."""

    def __init__(self, dims: ParallelDims, *, flash: bool):
        self.dims, self.flash = dims, flash  # flash: flash-attn's varlen kernel per document

    def install(self, config, *, varlen_ok: bool) -> None:
        install(config)

    def forward_micro(self, adapter, root, mb, ctx) -> torch.Tensor | ShardedLogits:
        with ctx.memory():
            return adapter.sp_forward(root, mb, self.dims, flash=self.flash)

    def forward(self, adapter, root, input_ids, position_ids, attention_mask, ctx) -> torch.Tensor:
        mb = MicroBatch(input_ids, position_ids, input_ids, attention_mask)
        out = self.forward_micro(adapter, root, mb, ctx)
        return out.full() if isinstance(out, ShardedLogits) else out
