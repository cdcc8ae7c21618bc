"""Log-probabilities of chosen tokens from logits, without a full-vocabulary float32 copy.

``log_softmax(logits / temperature)`` gathered at ``labels`` is ``z[label] - logsumexp(z)`` with
``z = logits / temperature``. Computing it as ``logits.float().log_softmax(-1).gather(...)`` keeps a
``[B, T, V]`` float32 tensor alive for the backward pass (about 4.6 GB for 8k tokens of a 150k
vocabulary). Here the rows are processed in chunks of at most ``CHUNK_ELEMENTS`` float32 values
(:func:`rlctl.algos.vocab_parallel.row_chunks`), nothing but the logits themselves is kept for the
backward pass, which recomputes the softmax chunk by chunk, so the extra memory is one float32 chunk.
The math is float32 (or float64 for float64 logits) whatever the logits' dtype, and the gradient
comes back in the logits' dtype.

Pass contiguous logits (slice the hidden states *before* the LM head) to avoid one copy of them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlctl.algos.vocab_parallel import VocabSlice, row_chunks

__all__ = ["entropy_from_log_softmax", "logprobs_from_logits"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scaled(logits: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    z = logits.to(dtype)
    return z if temperature == 1.0 else z / temperature


def entropy_from_log_softmax(log_probs: Tensor) -> Tensor:
    """``-sum(p * log p)`` over the last dim, from ``log_softmax`` output: ``[..., V]`` -> ``[...]``."""
    return torch.exp(log_probs).mul_(log_probs).sum(-1).neg_()


class _ChosenLogProb(torch.autograd.Function):
    """``log_softmax(logits / temperature)[label]`` over rows of a 2-D ``[N, V]`` logits tensor (and, with
    ``with_entropy``, each row's entropy from the same log-softmax, as a second, non-differentiable output)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool = False):
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(logits.shape[0], dtype=dtype, device=logits.device)
        entropy = torch.empty_like(out) if with_entropy else None
        for rows in row_chunks(logits):
            z = _scaled(logits[rows], dtype, temperature)
            log_probs = torch.log_softmax(z, dim=-1)
            out[rows] = log_probs.gather(-1, labels[rows, None]).squeeze(-1)
            if entropy is not None:
                entropy[rows] = entropy_from_log_softmax(log_probs)
        ctx.save_for_backward(logits, labels)
        ctx.temperature = temperature
        if entropy is None:
            return out
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, *_entropy_grad) -> tuple[Tensor, None, None, None]:
        logits, labels = ctx.saved_tensors
        temperature = ctx.temperature
        grad_logits = torch.empty_like(logits)
        for rows in row_chunks(logits):
            z = _scaled(logits[rows], grad_out.dtype, temperature)
            g = grad_out[rows, None]
            # d/dz (log_softmax(z)[label]) = onehot(label) - softmax(z); then d z / d logits = 1 / T
            grad = torch.softmax(z, dim=-1).mul_(-g).scatter_add_(-1, labels[rows, None], g)
            grad_logits[rows] = grad if temperature == 1.0 else grad.div_(temperature)
        return grad_logits, None, None, None


def logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0, *, with_entropy: bool = False):
    """``log_softmax(logits / temperature, -1)`` gathered at ``labels``: ``[..., V]`` -> ``[...]``.

    The result is float32 (float64 for float64 logits); differentiable w.r.t. ``logits``. With
    ``with_entropy``: ``(log-probs, entropy)``, the entropy of ``softmax(logits / temperature)`` per
    position from the same pass over the logits (no gradient). ``logits`` may be a
    :class:`~rlctl.algos.vocab_parallel.VocabSlice` (``[N, width]`` of a vocabulary split over ranks).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    if isinstance(logits, VocabSlice):  # split over the vocabulary (Megatron's TP): never gathered
        out, entropy = logits.logprobs(labels.reshape(-1), temperature)
        out, entropy = out.reshape(labels.shape), entropy.detach().reshape(labels.shape)
        return (out, entropy) if with_entropy else out
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_labels = labels.reshape(-1).to(device=logits.device, dtype=torch.long)
    if with_entropy:
        out, entropy = _ChosenLogProb.apply(flat_logits, flat_labels, float(temperature), True)
        return out.reshape(labels.shape), entropy.reshape(labels.shape)
    return _ChosenLogProb.apply(flat_logits, flat_labels, float(temperature)).reshape(labels.shape)
