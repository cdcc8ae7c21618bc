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
