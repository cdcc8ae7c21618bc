"""Per-token math on logits split over the vocabulary (Megatron's tensor parallelism): each rank of ``group``
holds the columns ``[start, start + width)`` of every position's logits, and no rank sees another's. The pattern
of megatron-core's ``vocab_parallel_cross_entropy``: each row's max, then its sums over the vocabulary, are
all-reduced over ``group``; every rank gets the same per-token values, and each rank's gradient is that of its
own columns (computed by hand from the all-reduced statistics, so the backward needs no collective; Megatron's
column-parallel output layer sums the hidden states' gradient over TP).

* token log-prob ``log p(y) = z_y - logsumexp(z)``, ``z = logits / temperature``: ``z_y`` from the rank owning
  column ``y`` (0 elsewhere, then summed), ``logsumexp(z) = m + log sum_v exp(z_v - m)`` with ``m`` the max;
* entropy ``H = logsumexp(z) - sum_v p_v z_v`` with the sum all-reduced;
* the exact reverse KL to a teacher (``algo.distill=full``) from both models' slices.

The math is float32 (float64 for float64 logits); the gradient comes back in the logits' dtype. The whole-
vocabulary versions: :mod:`rlctl.algos.logprobs`, :func:`rlctl.algos.kl.entropy_from_logits`,
:func:`rlctl.algos.distill.full_reverse_kl`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class VocabSlice:
    """This rank's columns ``[N, width]`` of ``N`` rows of logits, starting at vocabulary column ``start``; the
    other ranks of ``group`` hold the rest."""

    local: Tensor
    start: int
    group: Any

    def logprobs(self, labels: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
        """``[N]`` log-probs of ``labels`` and entropies of ``softmax(logits / temperature)``, both differentiable."""
        return vocab_parallel_logprobs(self.local, labels, self.start, temperature, self.group)


def _row_max(x: Tensor) -> Tensor:
    """The max of each row; -inf for a rank whose slice is all padding (no columns)."""
    return x.max(-1).values if x.shape[-1] else x.new_full(x.shape[:-1], float("-inf"))


def _scaled(local: Tensor, temperature: float) -> Tensor:
    """``local / temperature`` in the compute dtype (float32, or float64 for float64 logits)."""
    return local.to(torch.promote_types(local.dtype, torch.float32)) / temperature


class _VocabParallelLogProb(torch.autograd.Function):
    """(log-prob of each row's label, entropy) from this rank's slice; see the module's docstring. Saved for the
    backward: the logits themselves and ``[N]`` statistics; the forward and the backward each hold two float32
    copies of the slice at a time (the estimator's 8 bytes per logit, rlctl.estimate.settings.LOGIT_EXTRA_BYTES)."""

    @staticmethod
    def forward(ctx, local: Tensor, labels: Tensor, start: int, temperature: float, group):
        z = _scaled(local, temperature)
        m = _row_max(z)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z -= m[:, None]
        width = z.shape[-1]
        col = labels - start
        own = (col >= 0) & (col < width)
        picked = z.gather(-1, col.clamp(0, max(width - 1, 0))[:, None])[:, 0] if width else z.new_zeros(len(z))
        exp = z.exp()
        total = exp.sum(-1)
        sums = torch.stack([total, torch.where(own, picked, 0.0), exp.mul_(z).sum(-1)])
        dist.all_reduce(sums, group=group)
        lse = sums[0].log()  # (of the shifted z)
        logp, entropy = sums[1] - lse, lse - sums[2] / sums[0]
        ctx.save_for_backward(local, col, own, m + lse, entropy)  # m + lse: logsumexp(z)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):
        # d log p_y / dz_v = [v = y] - p_v;  dH/dz_v = -p_v (log p_v + H);  dz/dlogits = 1 / T
        local, col, own, lse, entropy = ctx.saved_tensors
        t = ctx.temperature
        log_p = _scaled(local, t)
        log_p -= lse[:, None]  # this rank's columns of log_softmax(z)
        grad = log_p.exp()
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
        if g_entropy is not None:  # -p_v (g_logp + g_entropy (log p_v + H))
            grad.mul_(log_p.add_(entropy[:, None]).mul_(g_entropy[:, None]).add_(g_logp[:, None]))
        else:
            grad.mul_(g_logp[:, None])
        grad.neg_()
        if grad.shape[-1]:
            grad.scatter_add_(-1, col.clamp(0, grad.shape[-1] - 1)[:, None], (g_logp * own)[:, None])
        return grad.div_(t).to(local.dtype), None, None, None, None


def vocab_parallel_logprobs(local: Tensor, labels: Tensor, start: int, temperature: float, group):
    """``[N]`` log-probs of ``labels`` (vocabulary ids) and ``[N]`` entropies of ``softmax(logits / temperature)``
    from this rank's columns ``[N, width]`` (from ``start``) of the logits, the same on every rank of ``group``;
    both differentiable w.r.t. ``local``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    labels = labels.to(device=local.device, dtype=torch.long)
    return _VocabParallelLogProb.apply(local, labels, int(start), float(temperature), group)


class _VocabParallelReverseKL(torch.autograd.Function):
    """:func:`~rlctl.algos.distill.full_reverse_kl` from this rank's slice of both models' logits: each softmax's
    max and sum of exponentials, then the KL's sum over the vocabulary, are all-reduced. The gradient
    (``dKL/dz_v = p_s(v) (log p_s(v) - log p_t(v) - KL) / T``) needs only this rank's slice."""

    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, temperature: float, group) -> Tensor:
        s, t = student.float() / temperature, teacher.float() / temperature
        maxes = torch.stack([_row_max(s), _row_max(t)])  # [2, N]
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        s, t = s - maxes[0, :, None], t - maxes[1, :, None]
        sums = torch.stack([s.exp().sum(-1), t.exp().sum(-1)])
        dist.all_reduce(sums, group=group)
        log_s, log_t = s - sums[0].log()[:, None], t - sums[1].log()[:, None]
        p_s, gap = log_s.exp(), log_s - log_t
        kl = (p_s * gap).sum(-1)
        dist.all_reduce(kl, group=group)
        ctx.save_for_backward(p_s, gap, kl)
        ctx.temperature, ctx.dtype = temperature, student.dtype
        return kl

    @staticmethod
    def backward(ctx, grad: Tensor):
        p_s, gap, kl = ctx.saved_tensors
        out = grad[:, None] * p_s * (gap - kl[:, None]) / ctx.temperature
        return out.to(ctx.dtype), None, None, None


def vocab_parallel_reverse_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float, group) -> Tensor:
    """``[N]`` :func:`~rlctl.algos.distill.full_reverse_kl` from this rank's slice ``[N, V_r]`` of both models'
    logits (the same vocabulary columns on both; the ranks of ``group`` hold the rest): the same value on every
    rank of ``group``, the gradient through the student's slice only."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"vocabulary slices differ: student {student_logits.shape}, teacher {teacher_logits.shape}")
    return _VocabParallelReverseKL.apply(student_logits, teacher_logits.detach(), temperature, group)
