"""Token rewards and advantages, computed on the global batch (gathered over the data-parallel
replicas, ordered by uid) with the estimator ``algo.adv`` names (:mod:`rlctl.algos.registry`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlctl.algos import get_adv_estimator
from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.recipes.rl.spec import AlgoSpec
from rlctl.runtime.dist import all_reduce_max


def last_sampled(mask: torch.Tensor) -> torch.Tensor:
    """[b] the column of each row's last mask-1 token (its last sampled token)."""
    cols = torch.arange(1, mask.shape[-1] + 1, device=mask.device, dtype=mask.dtype)
    return ((mask > 0) * cols).argmax(-1)


def token_rewards(batch: RolloutBatch, kl_coef: float = 0.0, kl: torch.Tensor | None = None) -> torch.Tensor:
    """The score on each response's last sampled token, minus ``kl_coef * kl`` on every token (KL in the reward)."""
    last = last_sampled(batch.mask)
    r = torch.zeros_like(batch.mask)
    r[torch.arange(len(batch), device=r.device), last] = batch.scores.to(r.dtype)
    if kl is not None and kl_coef:
        r = r - kl_coef * kl * batch.mask
    return r


def gather_global(
    batch: RolloutBatch, tensors: list[torch.Tensor], group: dist.ProcessGroup | None = None
) -> list[torch.Tensor]:
    """Each [b, W] tensor of every data-parallel replica (the ranks of ``group``, default all) gathered
    into one [total, W] tensor ordered by uid."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        out = []
        for t in tensors:
            g = t.new_zeros((batch.total, *t.shape[1:]))
            g[batch.uid] = t
            out.append(g)
        return out
    world = dist.get_world_size(group)
    b_max = all_reduce_max(len(batch), batch.mask.device)
    uid = torch.full((b_max,), -1, dtype=torch.int64, device=batch.mask.device)
    uid[: len(batch)] = batch.uid
    uids = [torch.empty_like(uid) for _ in range(world)]
    dist.all_gather(uids, uid, group=group)
    all_uid = torch.cat(uids)
    valid = all_uid >= 0
    out = []
    for t in tensors:
        padded = t.new_zeros((b_max, *t.shape[1:]))
        padded[: len(batch)] = t
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        g = t.new_zeros((batch.total, *t.shape[1:]))
        g[all_uid[valid]] = torch.cat(parts)[valid]
        out.append(g)
    return out


def compute_advantages(
    batch: RolloutBatch, algo: AlgoSpec, rewards: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [b, W], from token rewards: the estimator ``algo.adv`` names, on the
    global batch gathered over the data-parallel ``group``."""
    a = algo
    estimator = get_adv_estimator(a.adv)
    wanted = [rewards, batch.mask] + ([batch.values] if estimator.needs_critic else [])
    g = gather_global(batch, wanted, group)
    # Multi-turn rows have context tokens (mask 0) between their sampled turns: the estimator sees the
    # sampled tokens only, moved together (a tool turn is part of the environment's transition, not a step
    # of the policy), and its results go back to their columns.
    order = torch.sort((g[1] <= 0).to(torch.int8), dim=-1, stable=True).indices
    g = [t.gather(1, order) for t in g]
    extra = {}
    if estimator.needs_greedy:  # remax: the score of each row's greedy response, in uid order
        (extra["reward_baselines"],) = gather_global(batch, [batch.baselines], group)
    adv, returns = estimator.fn(
        g[0],
        g[1],
        n=batch.n,
        values=g[2] if estimator.needs_critic else None,
        gamma=a.gamma,
        lam=a.lam,
        norm_by_std=a.norm_by_std,
        **extra,
    )
    mask = batch.mask.new_zeros(g[1].shape).scatter_(1, order, g[1])  # the gathered mask, in place again
    adv = torch.zeros_like(adv).scatter_(1, order, adv) * mask
    returns = torch.zeros_like(returns).scatter_(1, order, returns) * mask
    return adv[batch.uid].float(), returns[batch.uid].float()
