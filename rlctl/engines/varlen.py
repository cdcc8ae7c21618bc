"""Per-document attention for packed rows: the cost is the sum of each document's squared length, not
the square of the row.

transformers runs a packed row (several documents, positions restarting at 0) under sdpa with one
block-diagonal ``[T, T]`` mask: every pair of positions of the row is computed and most are thrown
away. Here :func:`install` makes the model's attention :func:`attention`, which is transformers' sdpa
unless the forward is given ``rlctl_blocks`` (and a placeholder 4-D mask, so that no ``[T, T]`` mask is
built); with them each block of queries attends to the keys it may see:

* a document: its own positions, causally;
* a shared-prefix response (GRPO, :mod:`rlctl.recipes.rl.batch`): the whole prompt it answers and
  its own positions causally (Prefix Grouper, arXiv 2506.05433): the prompt is computed once per group.

Every block's queries and keys are gathered once per layer by index (:class:`Layout`, built once per
forward), so the backward scatters each of q, k and v's gradients into ONE full-size tensor, not one per
block. On CUDA with flash-attn installed (``rlctl_flash``) the gathered blocks go to flash-attn's varlen
kernel in one call (``cu_seqlens``; its causal mask is aligned bottom-right, which is exactly "the whole
prefix, then causal"). Otherwise sdpa runs once per bucket of blocks of similar length, each padded to
its bucket's longest (:func:`buckets`: at most twice the real tokens): one call when the lengths are
alike, a few when they are spread, never one per block.

The math is sdpa's on the same numbers, so log-probs and gradients equal a run of each document alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

NAME = "rlctl_varlen"

#: (row, start, end, prefix_start, prefix_end): queries ``start:end`` of ``row`` attend causally to
#: themselves and to every key of ``prefix_start:prefix_end`` (an empty prefix: a plain document).
Block = tuple[int, int, int, int, int]


def blocks_from_positions(position_ids: torch.Tensor) -> list[Block]:
    """The documents of packed rows ``[B, T]``: a new one wherever the position restarts at 0."""
    blocks: list[Block] = []
    for row, pos in enumerate(position_ids.tolist()):
        starts = [t for t, p in enumerate(pos) if p == 0 or t == 0]
        ends = starts[1:] + [len(pos)]
        blocks += [(row, s, e, s, s) for s, e in zip(starts, ends)]
    return blocks


def worth_splitting(blocks: Sequence[Block], rows: int) -> bool:
    """Splitting pays only when some row holds more than one block."""
    return len(blocks) > rows


#: Rows up to this many tokens run ONE sdpa call with the dense boolean mask of their blocks rather than
#: the blocks' own calls: there the calls cost more than the scores the mask throws away (measured on CPU,
#: GRPO's overhead regime, docs/bench.md, when each block was a call of its own; not remeasured since the
#: blocks are batched). CPU only: on a GPU a boolean mask rules out the flash kernels.
DENSE_MAX_LEN = 256


def dense_mask(blocks: Sequence[Block], rows: int, length: int, device: torch.device) -> torch.Tensor:
    """The ``[rows, 1, length, length]`` boolean mask (True: attend) that ``blocks`` describe; positions
    outside every block (padding) attend to themselves only (no empty softmax row)."""
    mask = torch.zeros(rows, length, length, dtype=torch.bool)
    for row, start, end, p0, p1 in blocks:
        mask[row, start:end, p0:p1] = True
        mask[row, start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    mask |= torch.eye(length, dtype=torch.bool)
    return mask[:, None].to(device)


def attention_kwargs(blocks: Sequence[Block], input_ids: torch.Tensor, *, split: bool = True) -> dict:
    """What a forward over shared-prefix rows ``input_ids`` [B, T] laid out as ``blocks`` passes the model: the blocks
    (attended per block by :func:`attention`, a placeholder mask) or, for rows of at most :data:`DENSE_MAX_LEN`
    tokens on a CPU, their dense mask (one call). ``split=False`` (an attention without per-block calls, e.g.
    eager): always the dense mask, so a response never sees its siblings."""
    rows, length = input_ids.shape
    if not split or (length <= DENSE_MAX_LEN and input_ids.device.type == "cpu"):  # measured on CPU only
        return {"attention_mask": dense_mask(blocks, rows, length, input_ids.device)}
    return {"attention_mask": placeholder_mask(input_ids.device), "rlctl_blocks": blocks}


class Layout:
    """Where the queries and keys of ``blocks`` sit in the flattened ``[B * T]`` positions of a forward:
    ``q_index`` / ``k_index`` (each block's queries; its prefix then its own positions as keys, in block
    order) with flash-attn's ``cu_seqlens``, and the padded index grids of each sdpa bucket."""

    def __init__(self, blocks: Sequence[Block], length: int, device: torch.device):
        q, k, q_len, k_len = [], [], [], []
        for row, start, end, p0, p1 in (b for b in blocks if b[2] > b[1]):  # (an empty block attends nothing)
            base = row * length
            q.append(range(base + start, base + end))
            k.append([*range(base + p0, base + p1), *range(base + start, base + end)])
            q_len.append(end - start)
            k_len.append(p1 - p0 + end - start)
        self.q_index = torch.tensor([i for r in q for i in r], dtype=torch.int64, device=device)
        self.k_index = torch.tensor([i for r in k for i in r], dtype=torch.int64, device=device)
        cu = [0, *torch.tensor(q_len).cumsum(0).tolist()], [0, *torch.tensor(k_len).cumsum(0).tolist()]
        self.cu_q, self.cu_k = (torch.tensor(c, dtype=torch.int32, device=device) for c in cu)
        self.max_q, self.max_k = max(q_len), max(k_len)
        self.buckets = [
            _Bucket([(q[b], k[b], k_len[b] - q_len[b]) for b in group], device) for group in buckets(q_len, k_len)
        ]


class _Bucket:
    """Blocks padded to the longest of them: ``q`` [n, Lq] and ``k`` [n, Lk] flat indices (0 where padded),
    ``valid`` [n, Lq] the real queries, and the boolean mask when a block has a prefix (None: causal)."""

    def __init__(self, blocks: list[tuple[Sequence[int], Sequence[int], int]], device: torch.device):
        lq, lk = max(len(b[0]) for b in blocks), max(len(b[1]) for b in blocks)
        q = torch.zeros(len(blocks), lq, dtype=torch.int64)
        k = torch.zeros(len(blocks), lk, dtype=torch.int64)
        valid = torch.zeros(len(blocks), lq, dtype=torch.bool)
        for i, (qi, ki, _) in enumerate(blocks):
            q[i, : len(qi)], k[i, : len(ki)], valid[i, : len(qi)] = torch.tensor(qi), torch.tensor(ki), True
        self.q, self.k, self.valid = q.to(device), k.to(device), valid.to(device)
        self.q_valid = self.q[self.valid]
        self.mask = None  # plain documents: causal (their keys are their queries' positions)
        if any(prefix for _, _, prefix in blocks):
            # query t sees the prefix and its own positions up to t (a padded query: the last real one's keys)
            last = torch.tensor([[prefix + min(t, len(qi) - 1) for t in range(lq)] for qi, _, prefix in blocks])
            self.mask = (torch.arange(lk)[None, None, :] <= last[:, :, None])[:, None].to(device)


def buckets(q_len: Sequence[int], k_len: Sequence[int]) -> list[list[int]]:
    """Blocks grouped for padded sdpa calls: longest first, a block joins the current bucket while the
    bucket's padded tokens stay within twice its real ones; plain documents and prefixed blocks apart."""
    out: list[list[int]] = []
    for prefixed in (False, True):
        order = sorted((b for b in range(len(q_len)) if (k_len[b] > q_len[b]) == prefixed), key=lambda b: -k_len[b])
        group: list[int] = []
        for b in order:
            trial = [*group, b]
            padded = len(trial) * (max(q_len[i] for i in trial) + max(k_len[i] for i in trial))
            if group and padded > 2 * sum(q_len[i] + k_len[i] for i in trial):
                out.append(group)
                trial = [b]
            group = trial
        if group:
            out.append(group)
    return out


def repeat_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, Hkv, T, d]`` -> ``[B, heads, T, d]``, each KV head repeated for its query heads (what
    ``enable_gqa`` does inside sdpa). sdpa's CUDA kernels that take a mask (memory-efficient, cuDNN) do
    not all take grouped heads with it in torch 2.13, and the fallback is the math kernel; flash takes
    grouped heads but no mask. So a masked call never sets ``enable_gqa`` (transformers does the same)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


_LAYOUTS: dict[tuple, Layout] = {}  # the last forward's layout: its layers share it


def layout_of(blocks: Sequence[Block], length: int, device: torch.device) -> Layout:
    key = (tuple(map(tuple, blocks)), length, str(device))
    if key not in _LAYOUTS:
        _LAYOUTS.clear()
        _LAYOUTS[key] = Layout(blocks, length, device)
    return _LAYOUTS[key]


def flash_varlen():
    """flash-attn's ``flash_attn_varlen_func``, or None where flash-attn is not installed."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, rlctl_blocks=None, rlctl_flash=False, **kwargs
):
    """transformers' attention-function signature: query ``[B, H, T, d]``, key/value ``[B, Hkv, T, d]``;
    returns ``([B, T, H, d], None)``. Positions outside every block (padding) get zeros. ``rlctl_flash``:
    flash-attn's varlen kernel (the engine passes it on CUDA where flash-attn is installed)."""
    if rlctl_blocks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    batch, heads, length, dim = query.shape
    lay = layout_of(rlctl_blocks, length, query.device)
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], dim) for x in (query, key, value))
    kernel = flash_varlen() if rlctl_flash else None
    if kernel is not None:
        k_rows, v_rows = k[lay.k_index], v[lay.k_index]
        outs = [
            kernel(
                q[lay.q_index],
                k_rows,
                v_rows,
                lay.cu_q,
                lay.cu_k,
                lay.max_q,
                lay.max_k,
                dropout_p=dropout,
                softmax_scale=scaling,
                causal=True,
            )
        ]
        where = [lay.q_index]
    else:
        outs, where = [], []
        for b in lay.buckets:
            qb, kb, vb = (x.transpose(1, 2) for x in (q[b.q], k[b.k], v[b.k]))  # [n, H, L, d]
            if b.mask is None:
                gqa = kb.shape[1] != heads
                out = F.scaled_dot_product_attention(
                    qb, kb, vb, is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa
                )
            else:
                kb, vb = repeat_kv_heads(kb, heads), repeat_kv_heads(vb, heads)
                out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask, scale=scaling, dropout_p=dropout)
            outs.append(out.transpose(1, 2)[b.valid])  # [real queries, H, d]
            where.append(b.q_valid)
    out = torch.cat(outs)  # the kernels' dtype (under autocast, bf16 from float32 q)
    flat = out.new_zeros(batch * length, heads, dim).index_copy(0, torch.cat(where), out)
    return flat.view(batch, length, heads, dim), None


def install(config) -> None:
    """Make :func:`attention` the attention of the model built from ``config`` (its masks: sdpa's)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation_internal = NAME


def placeholder_mask(device: torch.device) -> torch.Tensor:
    """A 4-D mask transformers passes through untouched (the blocks say what attends to what)."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
