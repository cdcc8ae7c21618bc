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

import math

import torch

from rlctl.algos.vocab_parallel import vocab_parallel_reverse_kl

__all__ = [
    "centred",
    "distill_gap",
    "divergence_metric",
    "full_reverse_kl",
    "generalized_jsd",
    "mix_advantages",
    "teacher_data_index",
    "vocab_parallel_reverse_kl",
]


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


def generalized_jsd(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float, beta: float
) -> torch.Tensor:
    """``[N]`` generalized Jensen-Shannon divergence over the vocabulary at each position (``algo.distill_beta``),
    TRL's GKD convention (Agarwal et al. 2024, Eq. 1): ``beta = 1`` the reverse KL ``KL(p_s || p_t)``
    (:func:`full_reverse_kl`, the default), ``beta = 0`` the forward KL ``KL(p_t || p_s)`` (the cross-entropy
    to the teacher's whole distribution, less its entropy), in between ``beta KL(p_t || m) + (1 - beta)
    KL(p_s || m)`` with ``m = (1 - beta) p_s + beta p_t``. Both softmaxes at ``temperature``, fp32, the
    gradient through the student only; the teacher read over the student's vocabulary."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (got {beta})")
    if beta == 1.0:
        return full_reverse_kl(student_logits, teacher_logits, temperature)
    v = student_logits.shape[-1]
    log_s = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    log_t = torch.log_softmax(teacher_logits[..., :v].detach().float() / temperature, dim=-1)
    if beta == 0.0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    return beta * (log_t.exp() * (log_t - log_m)).sum(-1) + (1.0 - beta) * (log_s.exp() * (log_s - log_m)).sum(-1)


def divergence_metric(beta: float) -> str:
    """The metric that logs the full-vocabulary loss's value at ``beta`` (``distill/reverse_kl`` at the default)."""
    return {1.0: "distill/reverse_kl", 0.0: "distill/forward_kl"}.get(beta, "distill/jsd")


def teacher_data_index(step: int, fraction: float, warmup: int) -> int | None:
    """Whether step ``step`` (0-based) trains on ``--teacher-data``'s rows (GKD's mixture): the first ``warmup``
    steps do, then ``fraction`` of the steps, spread evenly (an on-policy step first); its index among those steps
    (so which rows it reads: the schedule is a function of the step, nothing to save), or None for a step on the
    student's own samples."""
    if step < warmup:
        return step
    j = step - warmup
    before, after = math.floor(j * fraction + 1e-9), math.floor((j + 1) * fraction + 1e-9)
    return warmup + before if after > before else None
