"""On-policy distillation (``rlctl grpo --teacher MODEL``, docs/distill.md): the student samples, a frozen
teacher scores every sampled token, and each token's advantage is the stop-gradient log-prob gap

    A_t = log p_teacher(y_t | y_<t) - log p_student(y_t | y_<t)

the negative of the per-token reverse-KL estimate ``log p_student - log p_teacher`` on the student's own
samples (Agarwal et al. 2024, GKD; Thinking Machines' on-policy distillation; NeMo RL's MOPD). The policy
gradient with this advantage lowers ``KL(student || teacher)``. With ``weight < 1`` it is mixed with the
task reward's advantage: ``A = weight * gap + (1 - weight) * A_task``. With a baseline, the gap is taken
relative to its mean over the batch's sampled tokens (``gap - mean(gap)``): a constant baseline, so the
policy gradient's expectation is unchanged (discount 0: each token's advantage is its own gap) and only its
variance drops.

Not an ``algo.adv`` estimator (:mod:`rlctl.algos.registry`): those map rewards to advantages on the gathered
batch; this one is per token and local, so it is applied after the estimator, row by row. Tokens with mask 0
(prompt, padding, the tool and user turns of a multi-turn trajectory) get 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def distill_gap(teacher_logp: torch.Tensor, student_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[b, W] teacher minus student log-prob of each sampled token (0 where ``mask`` is 0), detached."""
    return ((teacher_logp.detach().float() - student_logp.detach().float()) * mask).to(torch.float32)


def centred(gap: torch.Tensor, mask: torch.Tensor, mean: float) -> torch.Tensor:
    """``gap - mean`` on the sampled tokens (0 where ``mask`` is 0): the gap against a constant baseline."""
    return (gap - mean) * mask


def mix_advantages(task: torch.Tensor, gap: torch.Tensor, mask: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight * gap + (1 - weight) * task`` on the sampled tokens (``weight`` in [0, 1])."""
    if weight == 1.0:
        return gap * mask
    return (weight * gap + (1.0 - weight) * task.float()) * mask


def full_reverse_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[N]`` exact reverse KL over the vocabulary at each position, ``sum_v p_s(v) (log p_s(v) - log p_t(v))``
    (``algo.distill=full``), both softmaxes at ``temperature``, in fp32. The gradient flows through the student's
    softmax only (the teacher's logits are detached). A teacher with more embedding rows than the student (padding
    rows, e.g. Qwen2.5-7B's 152064 vs 1.5B's 151936) is read over the student's vocabulary."""
    v = student_logits.shape[-1]
    if teacher_logits.shape[-1] < v:
        raise ValueError(f"the teacher has {teacher_logits.shape[-1]} logits per position, the student {v}")
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits[..., :v].detach().float() / temperature, dim=-1)
    return (log_s.exp() * (log_s - log_t)).sum(-1)


class _VocabParallelReverseKL(torch.autograd.Function):
    """:func:`full_reverse_kl` where each rank of ``group`` holds one slice of the vocabulary (Megatron's tensor
    parallelism), the pattern of megatron-core's vocab-parallel cross-entropy: each softmax's max and sum of
    exponentials, then the KL's sum over the vocabulary, are all-reduced; no rank sees another's logits.
    The gradient (``dKL/dz_v = p_s(v) (log p_s(v) - log p_t(v) - KL) / T``) needs only this rank's slice."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, temperature: float, group) -> torch.Tensor:
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
    def backward(ctx, grad: torch.Tensor):
        p_s, gap, kl = ctx.saved_tensors
        out = grad[:, None] * p_s * (gap - kl[:, None]) / ctx.temperature
        return out.to(ctx.dtype), None, None, None


def _row_max(x: torch.Tensor) -> torch.Tensor:
    """The max of each row; -inf for a rank whose slice is all padding (no columns)."""
    return x.max(-1).values if x.shape[-1] else x.new_full(x.shape[:-1], float("-inf"))


def vocab_parallel_reverse_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float, group
) -> torch.Tensor:
    """``[N]`` :func:`full_reverse_kl` from this rank's slice ``[N, V_r]`` of both models' logits (the same
    vocabulary columns on both; the ranks of ``group`` hold the rest): the same value on every rank of
    ``group``, the gradient through the student's slice only."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"vocabulary slices differ: student {student_logits.shape}, teacher {teacher_logits.shape}")
    return _VocabParallelReverseKL.apply(student_logits, teacher_logits.detach(), temperature, group)
