"""Log-probabilities of chosen tokens from logits, without a full-vocabulary float32 copy.

``log_softmax(logits / temperature)`` gathered at ``labels`` is ``z[label] - logsumexp(z)`` with
``z = logits / temperature``. Computing it as ``logits.float().log_softmax(-1).gather(...)`` keeps a
``[B, T, V]`` float32 tensor alive for the backward pass (about 4.6 GB for 8k tokens of a 150k
vocabulary). Here the rows are processed in chunks of at most ``CHUNK_ELEMENTS`` float32 values,
only the per-row ``logsumexp`` is kept, and the backward pass recomputes the softmax chunk by chunk,
so the extra memory is one chunk plus ``[B, T]`` floats. The math is float32 (or float64 for
float64 logits) whatever the logits' dtype, and the gradient comes back in the logits' dtype.

Pass contiguous logits (slice the hidden states *before* the LM head) to avoid one copy of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["logprobs_from_logits"]

CHUNK_ELEMENTS = 1 << 25  # 32M float32 values = 128 MiB per chunk


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


class _ChosenLogProb(torch.autograd.Function):
    """``log_softmax(logits / temperature)[label]`` over rows of a 2-D ``[N, V]`` logits tensor."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
        dtype = _compute_dtype(logits.dtype)
        n, vocab = logits.shape
        step = _rows_per_chunk(vocab)
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        out = torch.empty(n, dtype=dtype, device=logits.device)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            z = logits[rows].to(dtype) / temperature
            lse[rows] = torch.logsumexp(z, dim=-1)
            out[rows] = z.gather(-1, labels[rows, None]).squeeze(-1) - lse[rows]
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature = temperature
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        logits, labels, lse = ctx.saved_tensors
        temperature = ctx.temperature
        n, vocab = logits.shape
        grad_logits = torch.empty_like(logits)
        step = _rows_per_chunk(vocab)
        for start in range(0, n, step):
            rows = slice(start, start + step)
            z = logits[rows].to(lse.dtype) / temperature
            g = grad_out[rows].to(lse.dtype)
            # d/dz (z[label] - lse) = onehot(label) - softmax(z); then chain through z = logits / T.
            grad = torch.exp(z - lse[rows, None]).mul_(-g[:, None])
            grad.scatter_add_(-1, labels[rows, None], g[:, None])
            grad_logits[rows] = grad.div_(temperature)
        return grad_logits, None, None


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """``log_softmax(logits / temperature, -1)`` gathered at ``labels``: ``[..., V]`` -> ``[...]``.

    The result is float32 (float64 for float64 logits); differentiable w.r.t. ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1).to(device=logits.device, dtype=torch.long)
    out = _ChosenLogProb.apply(flat_logits, flat_labels, float(temperature))
    return out.reshape(labels.shape)
