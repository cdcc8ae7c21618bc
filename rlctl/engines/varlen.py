"""Per-document attention for packed rows with plain sdpa: the cost is the sum of each document's squared
length, not the square of the row.

transformers runs a packed row (several documents, positions restarting at 0) under sdpa with one
block-diagonal ``[T, T]`` mask: every pair of positions of the row is computed and most are thrown
away. flash-attention's varlen kernels skip them, but they need CUDA and the flash-attn package. Here
the row is split instead: :func:`install` makes the model's attention :func:`attention`, which is
transformers' sdpa unless the forward is given ``rlctl_blocks`` (and a placeholder 4-D mask, so that no
``[T, T]`` mask is built); with them it runs ``scaled_dot_product_attention`` once per block of
queries, with the keys that block may see:

* a document: its own positions, causally (``is_causal``, the fast kernels);
* a shared-prefix response (GRPO, :mod:`rlctl.recipes.rl.batch`): the whole prompt it answers and
  its own positions causally (Prefix Grouper, arXiv 2506.05433): the prompt is computed once per group.

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


#: Rows up to this many tokens run ONE sdpa call with the dense boolean mask of their blocks rather than a
#: call per block: there the per-block calls (and their slices' backward, each a full-size zero tensor)
#: cost more than the scores the mask throws away (measured on CPU, GRPO's overhead regime, docs/bench.md).
#: CPU only: on a GPU a boolean mask rules out the flash kernels, and nothing was measured there.
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
    (one sdpa call each, a placeholder mask) or, for rows of at most :data:`DENSE_MAX_LEN` tokens on a CPU,
    their dense mask (one call). ``split=False`` (an attention without per-block calls, e.g. eager): always
    the dense mask, so a response never sees its siblings."""
    rows, length = input_ids.shape
    if not split or (length <= DENSE_MAX_LEN and input_ids.device.type == "cpu"):  # measured on CPU only
        return {"attention_mask": dense_mask(blocks, rows, length, input_ids.device)}
    return {"attention_mask": placeholder_mask(input_ids.device), "rlctl_blocks": blocks}


def _block_attention(q, k, v, block: Block, scaling, dropout, gqa) -> torch.Tensor:
    row, start, end, p0, p1 = block
    qb = q[row : row + 1, :, start:end]
    kb, vb = k[row : row + 1, :, start:end], v[row : row + 1, :, start:end]
    if p1 == p0:
        return F.scaled_dot_product_attention(
            qb, kb, vb, is_causal=True, scale=scaling, dropout_p=dropout, enable_gqa=gqa
        )
    n, p = end - start, p1 - p0
    kb = torch.cat([k[row : row + 1, :, p0:p1], kb], dim=2)
    vb = torch.cat([v[row : row + 1, :, p0:p1], vb], dim=2)
    mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
    mask[:, p:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if gqa:  # a mask with enable_gqa takes torch's math kernel on CUDA (fp32 scores): repeat the KV heads
        kb, vb = repeat_kv_heads(kb, qb.shape[1]), repeat_kv_heads(vb, qb.shape[1])
    return F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scaling, dropout_p=dropout)


def repeat_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, Hkv, T, d]`` -> ``[B, heads, T, d]``, each KV head repeated for its query heads (what
    ``enable_gqa`` does inside sdpa). sdpa's CUDA kernels that take a mask (memory-efficient, cuDNN) do
    not all take grouped heads with it in torch 2.13, and the fallback is the math kernel; flash takes
    grouped heads but no mask. So a masked call never sets ``enable_gqa`` (transformers does the same)."""
    return x.repeat_interleave(heads // x.shape[1], dim=1) if x.shape[1] != heads else x


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, rlctl_blocks=None, **kwargs):
    """transformers' attention-function signature: query ``[B, H, T, d]``, key/value ``[B, Hkv, T, d]``;
    returns ``([B, T, H, d], None)``. Positions outside every block (padding) get zeros."""
    if rlctl_blocks is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    gqa = key.shape[1] != query.shape[1]
    batch, _, length, _ = query.shape
    pieces: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(batch)]
    for block in rlctl_blocks:
        pieces[block[0]].append((block[1], _block_attention(query, key, value, block, scaling, dropout, gqa)))
    rows = []
    for r in range(batch):
        parts, at = [], 0
        for start, out in sorted(pieces[r], key=lambda x: x[0]):
            if start > at:
                parts.append(query.new_zeros(1, query.shape[1], start - at, query.shape[3]))
            parts.append(out)
            at = start + out.shape[2]
        if at < length:
            parts.append(query.new_zeros(1, query.shape[1], length - at, query.shape[3]))
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


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
