"""Per-token math on logits split over the vocabulary (Megatron's tensor parallelism): each rank of ``group``
holds the columns ``[start, start + width)`` of every position's logits, and no rank sees another's. The pattern
of megatron-core's ``vocab_parallel_cross_entropy``: each row's max, then its sums over the vocabulary, are
all-reduced over ``group``; every rank gets the same per-token values, and each rank's gradient is that of its
own columns (computed by hand from the all-reduced statistics, so the backward needs no collective; Megatron's
column-parallel output layer sums the hidden states' gradient over TP).

* token log-prob ``log p(y) = z_y - logsumexp(z)``, ``z = logits / temperature``: ``z_y`` from the rank owning
  column ``y`` (0 elsewhere, then summed), ``logsumexp(z) = m + log sum_v exp(z_v - m)`` with ``m`` the max;
* entropy ``H = logsumexp(z) - sum_v p_v z_v`` with the sum all-reduced;
* TRL's generalized Jensen-Shannon divergence to a teacher from both models' slices (:func:`vocab_parallel_jsd`;
  ``beta=1`` is the exact reverse KL of ``algo.distill=full``, :func:`vocab_parallel_reverse_kl`).

Memory: the rows are processed in chunks of at most ``CHUNK_ELEMENTS`` values (:func:`row_chunks`, shared with
:mod:`rlctl.algos.logprobs`), each statistic computed chunk by chunk into ``[k, N]`` and all-reduced once for all
chunks; only the logits themselves and ``[N]`` statistics are saved for the backward, which recomputes each
chunk's softmax. Beside the logits and their gradient (in the logits' dtype), the extra memory is a few float32
temporaries of one chunk, whatever ``N``. The math is float32 (float64 for float64 logits); the gradient comes
back in the logits' dtype. The whole-vocabulary versions: :mod:`rlctl.algos.logprobs`,
:func:`rlctl.algos.kl.entropy_from_logits`, :mod:`rlctl.algos.distill`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

CHUNK_ELEMENTS = 1 << 25  # 32M float32 values = 128 MiB per chunk


def row_chunks(x: Tensor) -> list[slice]:
    """Row slices of a ``[N, V]`` tensor, each of at most ``CHUNK_ELEMENTS`` values (one row at least)."""
    step = max(1, CHUNK_ELEMENTS // max(x.shape[-1], 1))
    return [slice(i, i + step) for i in range(0, x.shape[0], step)]


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


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _scaled(local: Tensor, temperature: float) -> Tensor:
    """``local / temperature`` in the compute dtype (float32, or float64 for float64 logits)."""
    return local.to(_compute_dtype(local)) / temperature


def _row_max(x: Tensor) -> Tensor:
    """The max of each row; -inf for a rank whose slice is all padding (no columns)."""
    return x.max(-1).values if x.shape[-1] else x.new_full(x.shape[:-1], float("-inf"))


def _local_max(local: Tensor, temperature: float) -> Tensor:
    """``[N]`` max of this rank's ``local / temperature``, read in the logits' own dtype (no float32 copy):
    converting and dividing by ``temperature > 0`` keep the order, so it is the max of the scaled values."""
    return _scaled(_row_max(local), temperature)


def _by_chunks(local: Tensor, k: int, fn: Callable[[slice], Tensor]) -> Tensor:
    """``[k, N]``: ``fn(rows) -> [k, len(rows)]`` over the row chunks of ``local``, in the compute dtype."""
    out = local.new_empty(k, local.shape[0], dtype=_compute_dtype(local))
    for rows in row_chunks(local):
        out[:, rows] = fn(rows)
    return out


def _shifted(local: Tensor, shift: Tensor, temperature: float) -> Tensor:
    """``local / temperature - shift`` per row in the compute dtype: with the rows' max, the exponent of a
    stable softmax; with their whole-vocabulary ``logsumexp``, this rank's columns of the log-softmax."""
    return _scaled(local, temperature).sub_(shift[:, None])


class _VocabParallelLogProb(torch.autograd.Function):
    """(log-prob of each row's label, entropy) from this rank's slice; see the module's docstring. Two
    collectives (the max, then the stacked ``[3, N]`` sums); saved for the backward: the logits and ``[N]``
    statistics."""

    @staticmethod
    def forward(ctx, local: Tensor, labels: Tensor, start: int, temperature: float, group):
        m = _local_max(local, temperature)
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        width = local.shape[-1]
        col = labels - start
        own = (col >= 0) & (col < width)
        at = col.clamp(0, max(width - 1, 0))[:, None]

        def sums(rows: slice) -> Tensor:  # sum exp(z - m), z_y - m on the rank owning y, sum exp(z - m) (z - m)
            z = _shifted(local[rows], m[rows], temperature)
            picked = z.gather(-1, at[rows])[:, 0] if width else z.new_zeros(len(z))
            exp = z.exp()
            return torch.stack([exp.sum(-1), torch.where(own[rows], picked, 0.0), exp.mul_(z).sum(-1)])

        total = _by_chunks(local, 3, sums)
        dist.all_reduce(total, group=group)
        lse = total[0].log()  # (of the shifted z)
        logp, entropy = total[1] - lse, lse - total[2] / total[0]
        ctx.save_for_backward(local, at, own, m + lse, entropy)  # m + lse: logsumexp(z)
        ctx.temperature = temperature
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):
        # d log p_y / dz_v = [v = y] - p_v;  dH/dz_v = -p_v (log p_v + H);  dz/dlogits = 1 / T
        local, at, own, lse, entropy = ctx.saved_tensors
        t = ctx.temperature
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
        grad = torch.empty_like(local)
        for rows in row_chunks(local):
            log_p = _shifted(local[rows], lse[rows], t)  # this rank's columns of log_softmax(z)
            out = log_p.exp()
            if g_entropy is not None:  # -p_v (g_logp + g_entropy (log p_v + H))
                out.mul_(log_p.add_(entropy[rows, None]).mul_(g_entropy[rows, None]).add_(g_logp[rows, None]))
            else:
                out.mul_(g_logp[rows, None])
            out.neg_()
            if out.shape[-1]:
                out.scatter_add_(-1, at[rows], (g_logp[rows] * own[rows])[:, None])
            grad[rows] = out.div_(t)
        return grad, None, None, None, None


def vocab_parallel_logprobs(local: Tensor, labels: Tensor, start: int, temperature: float, group):
    """``[N]`` log-probs of ``labels`` (vocabulary ids) and ``[N]`` entropies of ``softmax(logits / temperature)``
    from this rank's columns ``[N, width]`` (from ``start``) of the logits, the same on every rank of ``group``;
    both differentiable w.r.t. ``local``."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    labels = labels.to(device=local.device, dtype=torch.long)
    return _VocabParallelLogProb.apply(local, labels, int(start), float(temperature), group)


def _log_mixture(log_s: Tensor, log_t: Tensor, beta: float) -> Tensor:
    """``log m``, ``m = (1 - beta) p_s + beta p_t``."""
    return torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))


def _d_student(log_s: Tensor, log_t: Tensor, beta: float) -> Tensor:
    """``g_v = dJSD/dp_s(v)`` (up to a constant per row, which the softmax's Jacobian cancels), ``0 < beta``:
    ``log p_s - log p_t`` for the reverse KL (``beta=1``), ``(1 - beta) (log p_s - log m)`` for the mixture."""
    if beta == 1:
        return log_s - log_t
    return (log_s - _log_mixture(log_s, log_t, beta)).mul_(1 - beta)


def _jsd_sums(log_s: Tensor, log_t: Tensor, beta: float) -> Tensor:
    """``[2, n]``: this rank's columns' share of each row's JSD and of ``sum_u p_s(u) g_u`` (:func:`_d_student`;
    0 at ``beta=0``, whose gradient ``p_s - p_t`` needs none)."""
    if beta == 0:  # KL(p_t || p_s)
        kl = (log_t.exp() * (log_t - log_s)).sum(-1)
        return torch.stack([kl, torch.zeros_like(kl)])
    g_mean = (log_s.exp() * _d_student(log_s, log_t, beta)).sum(-1)  # beta=1: KL(p_s || p_t)
    if beta == 1:
        return torch.stack([g_mean, g_mean])
    kl_t = (log_t.exp() * (log_t - _log_mixture(log_s, log_t, beta))).sum(-1)
    return torch.stack([beta * kl_t + g_mean, g_mean])  # g_mean = (1 - beta) KL(p_s || m)


class _VocabParallelJSD(torch.autograd.Function):
    """:func:`vocab_parallel_jsd` from this rank's slice of both models' logits: each softmax's max, then its sum
    of exponentials, then the JSD's and ``sum_u p_s(u) g_u``'s sums over the vocabulary are all-reduced (three
    collectives, each of a stacked ``[2, N]``). Saved for the backward: both models' logits and ``[N]``
    statistics; the gradient ``dJSD/dz_v = p_s(v) (g_v - sum_u p_s(u) g_u) / T`` (``(p_s(v) - p_t(v)) / T`` at
    ``beta=0``) is recomputed chunk by chunk from this rank's columns only."""

    @staticmethod
    def forward(ctx, student: Tensor, teacher: Tensor, temperature: float, beta: float, group) -> Tensor:
        m = torch.stack([_local_max(student, temperature), _local_max(teacher, temperature)])
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)

        def sum_exp(rows: slice) -> Tensor:
            s, t = _shifted(student[rows], m[0, rows], temperature), _shifted(teacher[rows], m[1, rows], temperature)
            return torch.stack([s.exp_().sum(-1), t.exp_().sum(-1)])

        norm = _by_chunks(student, 2, sum_exp)
        dist.all_reduce(norm, group=group)
        norm = norm.log_().add_(m)  # each row's logsumexp(z_s), logsumexp(z_t) over the whole vocabulary

        def sums(rows: slice) -> Tensor:
            log_s = _shifted(student[rows], norm[0, rows], temperature)
            log_t = _shifted(teacher[rows], norm[1, rows], temperature)
            return _jsd_sums(log_s, log_t, beta)

        out = _by_chunks(student, 2, sums)
        dist.all_reduce(out, group=group)
        ctx.save_for_backward(student, teacher, norm, out[1])
        ctx.temperature, ctx.beta = temperature, beta
        return out[0]

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        student, teacher, norm, g_mean = ctx.saved_tensors
        t, beta = ctx.temperature, ctx.beta
        grad = torch.empty_like(student)
        for rows in row_chunks(student):
            log_s, log_t = _shifted(student[rows], norm[0, rows], t), _shifted(teacher[rows], norm[1, rows], t)
            if beta == 0:
                out = log_s.exp_().sub_(log_t.exp_())
            else:
                out = _d_student(log_s, log_t, beta).sub_(g_mean[rows, None]).mul_(log_s.exp_())
            grad[rows] = out.mul_(grad_out[rows, None] / t)
        return grad, None, None, None, None


def vocab_parallel_jsd(student_logits: Tensor, teacher_logits: Tensor, temperature: float, beta: float, group):
    """``[N]`` generalized Jensen-Shannon divergence of TRL's ``GKDTrainer.generalized_jsd_loss`` (per token,
    before masking) from this rank's slice ``[N, V_r]`` of both models' logits (the same vocabulary columns on
    both; the ranks of ``group`` hold the rest), both softmaxes at ``temperature``: ``beta=0`` the forward KL
    ``KL(p_t || p_s)``, ``beta=1`` the reverse KL ``KL(p_s || p_t)``, otherwise
    ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with ``m = (1 - beta) p_s + beta p_t``. The same value on
    every rank of ``group``; the gradient through the student's slice only."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"vocabulary slices differ: student {student_logits.shape}, teacher {teacher_logits.shape}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    if not 0 <= beta <= 1:
        raise ValueError(f"beta must be in [0, 1] (got {beta})")
    return _VocabParallelJSD.apply(student_logits, teacher_logits.detach(), float(temperature), float(beta), group)


def vocab_parallel_reverse_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float, group) -> Tensor:
    """``[N]`` :func:`~rlctl.algos.distill.full_reverse_kl` ``KL(p_s || p_t)`` from this rank's slice: the
    :func:`vocab_parallel_jsd` at ``beta=1``."""
    return vocab_parallel_jsd(student_logits, teacher_logits, temperature, 1.0, group)
