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

from rlctl.algos.vocab_parallel import vocab_parallel_reverse_kl

__all__ = ["centred", "distill_gap", "full_reverse_kl", "mix_advantages", "vocab_parallel_reverse_kl"]


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
