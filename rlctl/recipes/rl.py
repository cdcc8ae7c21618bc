"""What the GRPO and PPO recipes share: batches, log-prob passes, advantages, updates, the run loop.

One RL step (the recipes spell it out in order)::

    batch = rl.generate(step)    # prompts -> n samples each, on every rank's colocated rollout engine
    rl.score(batch, step)        # reward function -> one score per sample
    batch = rl.pool(batch)       # the ranks of one model replica (Megatron TP x PP) pool their samples
    rl.ref_logprobs(batch)       # frozen reference policy (when algo.kl_coef > 0)
    rl.old_logprobs(batch)       # the trainer's log-probs of the samples (+ rollout/logprob_diff)
    rl.values(batch)             # PPO: the critic's values
    rl.advantages(batch)         # token rewards (KL in the reward for PPO) -> grpo/rloo/reinforce_pp/gae
    rl.update_critic(batch)      # PPO
    rl.update_actor(batch)       # ppo_epochs x mini-batches, one optimizer step per mini-batch

Where the samples live. The step's global batch is ``train.batch_size`` prompts, fixed by the step
number alone (:class:`~rlctl.data.packing.StepSampler`). It is cut into mini-batches of
``algo.mini_batch_size`` prompts (one optimizer step each) and the prompts of each mini-batch are
dealt round-robin to the ranks (:func:`rank_positions`). A rank generates all ``n`` samples of its
prompts, so a prompt's group never crosses ranks, and every rank holds its share of every
mini-batch. Sample ``j`` of the prompt at position ``p`` of the step has the global id
``uid = p * n + j``. After scoring, the ranks that split one copy of the model between them
(Megatron's tensor and pipeline ranks: the engine's ``mp_group``) pool their samples, so every rank of
a data-parallel replica trains on the same batch (:meth:`RolloutBatch.join`); with FSDP every rank is
its own replica and no sample moves.

Why the update does not depend on the number of ranks. Advantages are computed on the gathered
global batch (ordered by uid), so batch-level statistics (whitening) are global. Each mini-batch's
loss is aggregated with *global* denominators (tokens and sequences all-reduced over the
data-parallel replicas: the engine's ``dp_group``), each replica back-propagates its share, and the
engine SUMS gradients over replicas (:mod:`rlctl.engines.base`). Micro-batches are packed per
replica under a token budget; replicas with fewer micro-batches run empty dummy ones, so the
collectives line up.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, replace

import torch
import torch.distributed as dist

from rlctl.algos import (
    AdaptiveKLController,
    FixedKLController,
    aggregate,
    entropy_from_logits,
    gae,
    grpo,
    gspo_policy_loss,
    kl_estimate,
    logprobs_from_logits,
    ppo_policy_loss,
    reinforce_pp,
    rloo,
    value_loss,
)
from rlctl.config import RunConfig
from rlctl.data.packing import StepSampler, pack_bins
from rlctl.data.rl import Prompt, RLData, build_rl_data
from rlctl.engines import build_engine
from rlctl.engines.base import (
    LossFn,
    TrainEngine,
    load_tokenizer,
    model_source,
    write_model_meta,
)
from rlctl.engines.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from rlctl.errors import UserError
from rlctl.metrics import MetricsLogger
from rlctl.recipes.common import (
    RunContext,
    all_reduce_sum,
    barrier,
    rng_state,
    set_rng_state,
    write_json_atomic,
)

LOGPROB_DIFF_WARN = 0.1  # mean |rollout - trainer| log-prob above this: the engines disagree
ENTROPY_CHUNK_ROWS = 1024  # rows of logits per entropy chunk (bounds the float32 copy)


# ---------------------------------------------------------------------------------------------
# Collectives


def all_reduce_max(value: int, device: torch.device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def global_sums(
    values: dict[str, float], device: torch.device, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Sum a dict of floats over the ranks of ``group`` (default: all; every rank must pass the same keys)."""
    keys = sorted(values)
    return dict(zip(keys, all_reduce_sum([float(values[k]) for k in keys], device, group)))


def all_gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# ---------------------------------------------------------------------------------------------
# Which prompts a rank takes


def mini_batch_ranges(batch_size: int, mini_batch_size: int) -> list[range]:
    """Prompt positions of each mini-batch of a step (the last may be smaller)."""
    m = mini_batch_size or batch_size
    return [range(s, min(s + m, batch_size)) for s in range(0, batch_size, m)]


def rank_positions(batch_size: int, mini_batch_size: int, rank: int, world: int) -> list[int]:
    """Prompt positions (0..batch_size-1) this rank takes: its round-robin share of every mini-batch."""
    return [p for r in mini_batch_ranges(batch_size, mini_batch_size) for p in r if (p - r.start) % world == rank]


# ---------------------------------------------------------------------------------------------
# The batch of one step on one rank


@dataclass
class RolloutBatch:
    """This rank's samples of one step. Per-token tensors are ``[b, width]`` (width = max response
    length), zero past each response; ``mask`` is 1 on response tokens."""

    prompts: list[list[int]]  # prompt token ids, one entry per sample
    responses: list[list[int]]  # response token ids (the stop token included when it stopped)
    uid: torch.Tensor  # [b] int64 global sample id: position * n + j
    mini: torch.Tensor  # [b] int64 mini-batch of each sample
    n: int  # samples per prompt
    num_minis: int  # mini-batches in the step (the same on every rank)
    total: int  # samples in the step over all ranks
    mask: torch.Tensor
    rollout_logp: torch.Tensor  # the rollout engine's log-probs
    truncated: torch.Tensor  # [b] bool: stopped by the length budget
    meta: list[Prompt] = field(default_factory=list)  # the prompt of each sample (reward arguments)
    scores: torch.Tensor | None = None  # [b]
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.responses)

    @classmethod
    def build(
        cls,
        prompts: list[list[int]],
        responses: list[list[int]],
        rollout_logp: list[list[float]],
        uid: list[int],
        *,
        n: int,
        batch_size: int,
        mini_batch_size: int,
        width: int,
        truncated: list[bool] | None = None,
        meta: list[Prompt] | None = None,
        device: torch.device | str = "cpu",
    ) -> RolloutBatch:
        """A batch from plain lists (one entry per sample); ``batch_size`` = prompts in the step."""
        b = len(responses)
        mask = torch.zeros(b, width, device=device)
        logp = torch.zeros(b, width, device=device)
        for i, (resp, lp) in enumerate(zip(responses, rollout_logp)):
            if not 0 < len(resp) <= width:
                raise ValueError(f"response {i} has {len(resp)} tokens; expected 1..{width}")
            mask[i, : len(resp)] = 1.0
            logp[i, : len(resp)] = torch.tensor(lp, dtype=torch.float32)
        m = mini_batch_size or batch_size
        uid_t = torch.tensor(uid, dtype=torch.int64, device=device).reshape(-1)
        return cls(
            prompts=[list(p) for p in prompts],
            responses=[list(r) for r in responses],
            uid=uid_t,
            mini=uid_t // n // m,
            n=n,
            num_minis=math.ceil(batch_size / m),
            total=batch_size * n,
            mask=mask,
            rollout_logp=logp,
            truncated=torch.tensor(truncated or [False] * b, dtype=torch.bool, device=device),
            meta=list(meta or []),
        )

    @property
    def lengths(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses)]

    def to(self, device: torch.device | str) -> RolloutBatch:
        """A copy with every tensor on ``device``."""
        moved = {f.name: v.to(device) for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    @classmethod
    def join(cls, parts: list[RolloutBatch]) -> RolloutBatch:
        """One batch holding the samples of ``parts`` (batches of the same step), in order."""
        out = {}
        for f in fields(cls):
            values = [getattr(p, f.name) for p in parts]
            if isinstance(values[0], list):
                out[f.name] = [x for v in values for x in v]
            elif isinstance(values[0], torch.Tensor):
                out[f.name] = torch.cat(values)
            else:  # the step's n, num_minis, total; None for what is not computed yet
                out[f.name] = values[0]
        return cls(**out)


# ---------------------------------------------------------------------------------------------
# Packed micro-batches


@dataclass
class MicroBatch:
    """Several samples packed into one row ``[1, T]``, positions restarting at 0 for each."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor  # [k] the batch rows it holds (empty for a dummy)
    logit_index: torch.Tensor  # [N] positions whose logits predict the response tokens
    labels: torch.Tensor  # [N] the response tokens
    token_row: torch.Tensor  # [N] row (0..k-1) of each response token in the micro-batch matrix
    token_col: torch.Tensor  # [N] its index within its response
    width: int  # longest response in it

    @property
    def dummy(self) -> bool:
        return self.rows.numel() == 0

    def to_matrix(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-token values [N] -> [k, width] (zero past each response); differentiable."""
        out = flat.new_zeros(self.rows.numel(), self.width)
        return out.index_put((self.token_row, self.token_col), flat)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This micro-batch's rows of a per-token batch tensor [b, W] -> [k, width]."""
        return t[self.rows, : self.width]


def _collate(batch: RolloutBatch, rows: list[int], device: torch.device) -> MicroBatch:
    ids: list[int] = []
    pos: list[int] = []
    logit_index: list[int] = []
    labels: list[int] = []
    token_row: list[int] = []
    token_col: list[int] = []
    for r, i in enumerate(rows):
        prompt, resp = batch.prompts[i], batch.responses[i]
        start = len(ids)
        ids += prompt + resp
        pos += range(len(prompt) + len(resp))
        # logits at position t predict token t+1
        logit_index += range(start + len(prompt) - 1, start + len(prompt) + len(resp) - 1)
        labels += resp
        token_row += [r] * len(resp)
        token_col += range(len(resp))

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=device)

    return MicroBatch(
        t(ids)[None],
        t(pos)[None],
        t(rows),
        t(logit_index),
        t(labels),
        t(token_row),
        t(token_col),
        max(len(batch.responses[i]) for i in rows),
    )


def _dummy(pad_id: int, device: torch.device) -> MicroBatch:
    one = torch.tensor([[pad_id]], dtype=torch.int64, device=device)
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return MicroBatch(one, torch.zeros_like(one), empty, empty, empty, empty, empty, 0)


def micro_batches(
    batch: RolloutBatch, rows: list[int], *, budget: int, pad_id: int, device: torch.device
) -> list[MicroBatch]:
    """The given rows packed first-fit-decreasing into micro-batches of at most ``budget`` tokens,
    padded with dummies to the same count on every rank (collective)."""
    lengths = batch.lengths
    bins = pack_bins([lengths[i] for i in rows], budget) if rows else []
    count = all_reduce_max(len(bins), device)
    out = [_collate(batch, [rows[j] for j in b], device) for b in bins]
    return out + [_dummy(pad_id, device) for _ in range(count - len(bins))]


def token_budget(cfg: RunConfig, plan) -> int:
    """Tokens per packed micro-batch on one device: ``train.max_tokens_per_micro_batch``, else
    micro_batch_size x (max prompt + max response), and never below one full sequence."""
    seq = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    mbs = cfg.train.micro_batch_size or getattr(plan, "micro_batch_size", 0) or 1
    return max(cfg.train.max_tokens_per_micro_batch or mbs * seq, seq)


# ---------------------------------------------------------------------------------------------
# Forward passes


def chunked_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per row [N, V] -> [N], without gradient, in row chunks."""
    with torch.no_grad():
        parts = [entropy_from_logits(c.float() / temperature) for c in logits.split(ENTROPY_CHUNK_ROWS)]
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def compute_logprobs(
    engine: TrainEngine,
    batch: RolloutBatch,
    *,
    temperature: float,
    budget: int,
    pad_id: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [b, W] of the sampled tokens under ``engine`` (and the per-token entropy when asked)."""

    def per_token(logits, mb):
        sel = logits[0, mb.logit_index]  # the positions that predict response tokens
        out = {"logp": logprobs_from_logits(sel, mb.labels, temperature).float()}
        if with_entropy:
            out["entropy"] = chunked_entropy(sel, temperature)
        return None, out

    micro = micro_batches(batch, list(range(len(batch))), budget=budget, pad_id=pad_id, device=batch.mask.device)
    engine.train(False)
    outs = engine.forward_backward(micro, per_token, forward_only=True)
    engine.train(True)
    logp = torch.zeros_like(batch.mask)
    ent = torch.zeros_like(batch.mask) if with_entropy else None
    for mb, out in zip(micro, outs):
        if not mb.dummy:
            logp[mb.rows, : mb.width] = mb.to_matrix(out["logp"])
            if ent is not None:
                ent[mb.rows, : mb.width] = mb.to_matrix(out["entropy"])
    return logp, ent


def compute_values(critic: TrainEngine, batch: RolloutBatch, *, budget: int, pad_id: int) -> torch.Tensor:
    """The critic's value [b, W] of the state before each response token."""
    micro = micro_batches(batch, list(range(len(batch))), budget=budget, pad_id=pad_id, device=batch.mask.device)
    critic.train(False)
    outs = critic.forward_backward(micro, lambda v, mb: (None, v[0, mb.logit_index].float()), forward_only=True)
    critic.train(True)
    values = torch.zeros_like(batch.mask)
    for mb, v in zip(micro, outs):
        if not mb.dummy:
            values[mb.rows, : mb.width] = mb.to_matrix(v)
    return values


# ---------------------------------------------------------------------------------------------
# Rewards and advantages


def token_rewards(batch: RolloutBatch, kl_coef: float = 0.0, kl: torch.Tensor | None = None) -> torch.Tensor:
    """The score on each response's last token, minus ``kl_coef * kl`` on every token (KL in the reward)."""
    last = batch.mask.sum(-1).long() - 1
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
    batch: RolloutBatch, cfg: RunConfig, rewards: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [b, W], from token rewards; computed on the global batch gathered
    over the data-parallel ``group``."""
    a = cfg.algo
    wanted = [rewards, batch.mask] + ([batch.values] if a.adv == "gae" else [])
    g = gather_global(batch, wanted, group)
    g_rewards, g_mask = g[0], g[1]
    if a.adv in ("grpo", "rloo"):
        scores = (g_rewards * g_mask).sum(-1)
        groups = torch.arange(batch.total, device=scores.device) // batch.n
        seq_adv = grpo(scores, groups, norm_by_std=a.norm_by_std) if a.adv == "grpo" else rloo(scores, groups)
        adv = seq_adv[:, None].to(g_mask.dtype) * g_mask
        returns = adv
    elif a.adv == "reinforce_pp":
        adv = reinforce_pp(g_rewards, g_mask, gamma=a.gamma)
        returns = adv
    elif a.adv == "gae":
        adv, returns = gae(g_rewards, g[2], g_mask, gamma=a.gamma, lam=a.lam)
    else:
        raise UserError(f"unknown advantage estimator algo.adv={a.adv}")
    return adv[batch.uid].float(), returns[batch.uid].float()


# ---------------------------------------------------------------------------------------------
# Updates


class Sums:
    """Local sums of metrics, reduced over the data-parallel replicas once at the end. The keys are
    fixed up front: a replica without samples must still take part in the reduction with the same keys."""

    def __init__(self, *keys: str) -> None:
        self.values: dict[str, float] = dict.fromkeys(keys, 0.0)

    def add(self, key: str, value: float | torch.Tensor) -> None:
        self.values[key] += float(value)

    def add_all(self, results: list[dict]) -> None:
        """Add the metric dicts that loss functions returned (one per micro-batch)."""
        for result in results:
            for key, value in result.items():
                self.add(key, value)

    def reduce(self, device: torch.device, group: dist.ProcessGroup | None = None) -> dict[str, float]:
        return global_sums(self.values, device, group)


def _denominators(batch: RolloutBatch, rows: list[int], group: dist.ProcessGroup | None) -> tuple[float, float]:
    """Response tokens and sequences of one mini-batch over all data-parallel replicas."""
    idx = torch.tensor(rows, dtype=torch.int64, device=batch.mask.device)
    tokens, seqs = all_reduce_sum(
        [float(batch.mask[idx].sum()) if rows else 0.0, float(len(rows))], batch.mask.device, group
    )
    return tokens, seqs


def _minis(batch: RolloutBatch) -> list[list[int]]:
    """This replica's rows of each mini-batch (some may be empty); the same count on every rank."""
    mini = batch.mini.tolist()
    return [[i for i in range(len(batch)) if mini[i] == k] for k in range(batch.num_minis)]


def policy_loss_fn(batch: RolloutBatch, cfg: RunConfig, denoms: dict, kl_loss_coef: float) -> LossFn:
    """The engine's ``loss_fn`` for one mini-batch of the actor update:
    ``pg + kl_loss_coef * agg(kl(logp, ref)) - entropy_coef * agg(entropy)``, every term aggregated with
    the mini-batch's global token / sequence counts (``denoms``); returns the loss and its metrics."""
    a = cfg.algo
    temperature = cfg.rollout.temperature or 1.0
    policy_loss = gspo_policy_loss if a.policy_loss == "gspo" else ppo_policy_loss

    def loss_fn(logits: torch.Tensor, mb: MicroBatch):
        if mb.dummy:
            return logits.sum() * 0.0, {}  # a backward pass keeps this replica in the collectives
        sel = logits[0, mb.logit_index]  # the positions that predict response tokens
        mask = mb.take(batch.mask)
        logp = mb.to_matrix(logprobs_from_logits(sel, mb.labels, temperature))
        loss, m = policy_loss(
            logp,
            mb.take(batch.old_logp),
            mb.take(batch.advantages),
            mask,
            clip_low=a.clip_low,
            clip_high=a.clip_high,
            dual_clip=a.dual_clip or None,
            agg=a.loss_agg,
            **denoms,
        )
        n_tok = mask.sum()
        stats = {
            "pg/loss": loss.detach(),
            "pg/clip_frac": m["clip_frac"] * n_tok,
            "pg/approx_kl": m["approx_kl"] * n_tok,
        }
        if kl_loss_coef:
            kl_loss = aggregate(kl_estimate(logp, mb.take(batch.ref_logp), a.kl_kind), mask, a.loss_agg, **denoms)
            loss = loss + kl_loss_coef * kl_loss
            stats["kl_loss"] = kl_loss.detach()
        if a.entropy_coef:
            ent = mb.to_matrix(entropy_from_logits(sel.float() / temperature))
            loss = loss - a.entropy_coef * aggregate(ent, mask, a.loss_agg, **denoms)
        return loss, stats

    return loss_fn


def update_actor(
    engine: TrainEngine, batch: RolloutBatch, cfg: RunConfig, *, budget: int, pad_id: int, kl_loss_coef: float = 0.0
) -> dict[str, float]:
    """``algo.ppo_epochs`` passes over the mini-batches, one optimizer step each (loss: :func:`policy_loss_fn`)."""
    device, group = batch.mask.device, engine.dp_group
    sums = Sums("pg/loss", "pg/clip_frac", "pg/approx_kl", "kl_loss", "tokens")
    grad_norms: list[float] = []
    for _ in range(cfg.algo.ppo_epochs):
        for rows in _minis(batch):
            tokens, seqs = _denominators(batch, rows, group)
            denoms = {"global_tokens": tokens, "global_seqs": seqs, "norm_len": cfg.rollout.max_response_len}
            micro = micro_batches(batch, rows, budget=budget, pad_id=pad_id, device=device)
            sums.add_all(engine.forward_backward(micro, policy_loss_fn(batch, cfg, denoms, kl_loss_coef)))
            grad_norms.append(engine.step())  # the global norm, the same on every rank
            sums.add("tokens", float(batch.mask[rows].sum()) if rows else 0.0)
    s = sums.reduce(device, group)
    steps = len(grad_norms)
    out = {
        "pg/loss": s["pg/loss"] / steps,
        "grad_norm": sum(grad_norms) / steps,
        "pg/clip_frac": s["pg/clip_frac"] / max(1.0, s["tokens"]),
        "pg/approx_kl": s["pg/approx_kl"] / max(1.0, s["tokens"]),
    }
    if kl_loss_coef:
        out["kl_loss"] = s["kl_loss"] / steps
    return out


def value_loss_fn(batch: RolloutBatch, cfg: RunConfig, tokens: float, seqs: float) -> LossFn:
    """The critic's ``loss_fn`` for one mini-batch: the clipped value loss on the returns, aggregated
    with the mini-batch's global token / sequence counts."""
    a = cfg.algo

    def loss_fn(v: torch.Tensor, mb: MicroBatch):
        if mb.dummy:
            return v.sum() * 0.0, {}
        mask = mb.take(batch.mask)
        values = mb.to_matrix(v[0, mb.logit_index])
        loss, m = value_loss(
            values,
            mb.take(batch.values),
            mb.take(batch.returns),
            mask,
            clip=a.vf_clip or None,
            agg=a.loss_agg,
            global_tokens=tokens,
            global_seqs=seqs,
            norm_len=cfg.rollout.max_response_len,
        )
        return loss, {"critic/value_loss": loss.detach(), "critic/vf_clip_frac": m["vf_clip_frac"] * mask.sum()}

    return loss_fn


def update_critic(
    critic: TrainEngine, batch: RolloutBatch, cfg: RunConfig, *, budget: int, pad_id: int
) -> dict[str, float]:
    """The clipped value loss on the returns, ``algo.ppo_epochs`` passes over the mini-batches."""
    device, group = batch.mask.device, critic.dp_group
    sums = Sums("critic/value_loss", "critic/vf_clip_frac", "tokens")
    grad_norms: list[float] = []
    for _ in range(cfg.algo.ppo_epochs):
        for rows in _minis(batch):
            tokens, seqs = _denominators(batch, rows, group)
            micro = micro_batches(batch, rows, budget=budget, pad_id=pad_id, device=device)
            sums.add_all(critic.forward_backward(micro, value_loss_fn(batch, cfg, tokens, seqs)))
            grad_norms.append(critic.step())
            sums.add("tokens", float(batch.mask[rows].sum()) if rows else 0.0)
    s = sums.reduce(device, group)
    steps = len(grad_norms)
    return {
        "critic/value_loss": s["critic/value_loss"] / steps,
        "critic/vf_clip_frac": s["critic/vf_clip_frac"] / max(1.0, s["tokens"]),
        "critic/grad_norm": sum(grad_norms) / steps,
    }


# ---------------------------------------------------------------------------------------------
# Rewards


def reward_manager(cfg: RunConfig, data: RLData, tokenizer, device: torch.device):
    """The run's :class:`rlctl.rewards.RewardManager` (all reward logic lives in rlctl/rewards)."""
    import os

    from rlctl.rewards import RewardManager

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return RewardManager.for_run(cfg, data, tokenizer, device=str(device), local_world=local_world)


# ---------------------------------------------------------------------------------------------
# The run


class RLTrainer:
    """Everything one GRPO / PPO run holds, and the steps the recipes call in order."""

    def __init__(self, ctx: RunContext, *, with_critic: bool):
        cfg, plan, d = ctx.cfg, ctx.plan, ctx.dist
        self.ctx, self.cfg, self.dist = ctx, cfg, d
        a = cfg.algo
        if with_critic and a.adv != "gae":
            raise UserError(
                f"rlctl ppo trains a critic for GAE advantages; algo.adv={a.adv} needs no critic: "
                f"use `rlctl grpo --adv {a.adv}` or set algo.adv=gae"
            )
        if not with_critic and a.adv == "gae":
            raise UserError("algo.adv=gae needs a critic: use `rlctl ppo`, or --adv grpo, rloo or reinforce_pp")
        if a.adv in ("grpo", "rloo") and cfg.rollout.n < 2:
            raise UserError(f"algo.adv={a.adv} compares the samples of a prompt; set rollout.n >= 2 (e.g. --n 8)")
        if a.kl_target and not a.kl_coef:
            raise UserError("algo.kl_target (adaptive KL) needs an initial algo.kl_coef > 0, e.g. --kl-coef 0.001")

        self.source = model_source(cfg.model.name, random_init=cfg.model.random_init)
        self.tokenizer = load_tokenizer(self.source)
        self.pad_id = self.tokenizer.pad_token_id
        self.data = build_rl_data(cfg, self.tokenizer)
        ctx.log(f"data: {self.data.report.summary()}; {len(self.data.train)} train / {len(self.data.val)} val prompts")
        self.rewards = reward_manager(cfg, self.data, self.tokenizer, d.device)
        self.reward_totals: dict[str, int] = {}
        self.sampler = StepSampler(
            len(self.data.train), cfg.train.batch_size, seed=cfg.train.seed, shuffle=cfg.data.shuffle
        )
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * self.sampler.steps_per_epoch
        self.mini_batch_size = min(a.mini_batch_size or self.sampler.batch_size, self.sampler.batch_size)
        optimizer_steps = self.total_steps * a.ppo_epochs * math.ceil(self.sampler.batch_size / self.mini_batch_size)
        self.budget = token_budget(cfg, plan)
        self.temperature = cfg.rollout.temperature or 1.0

        self.actor = build_engine(cfg, plan, role="actor", total_steps=optimizer_steps, source=self.source)
        self.ref = build_engine(cfg, plan, role="ref", trainable=False, source=self.source) if a.kl_coef > 0 else None
        self.critic = (
            build_engine(cfg, plan, role="critic", total_steps=optimizer_steps, lr=a.critic_lr, source=self.source)
            if with_critic
            else None
        )
        self.device = self.actor.device
        self.dp_group = self.actor.dp_group  # sums over the (pooled) data: over the data-parallel replicas
        if d.is_main:
            write_model_meta(ctx.paths.model_meta, self.actor.hf_config, self.tokenizer, self.source)
        barrier()
        self.kl_ctl = AdaptiveKLController(a.kl_coef, a.kl_target) if a.kl_target else FixedKLController(a.kl_coef)
        self.rollout_dtype = "fp32" if self.actor.compute_dtype == torch.float32 else "bf16"
        self.rollout = self._make_rollout(plan)
        self.weights_stale = False  # the rollout engine's weights lag the actor's
        self._asleep = False
        self.m: dict[str, float] = {}  # the current step's metrics

    def _make_rollout(self, plan):
        from rlctl.rollout import make_rollout_engine

        cfg, d = self.cfg, self.dist
        name = cfg.rollout.engine if cfg.rollout.engine != "auto" else (getattr(plan, "rollout", None) or "hf")
        path = self.source.path
        if self.source.random_init:  # no weights on disk: the rollout engine starts from the actor's
            path = str(self.actor.export_hf(self.ctx.paths.root / "rollout_init", self.ctx.paths.model_meta))
        device = f"cuda:{d.local_rank}" if self.device.type == "cuda" else "cpu"
        self.rollout_tp = cfg.rollout.tp or getattr(plan, "rollout_tp", 1) or 1
        if d.world_size % self.rollout_tp:
            raise UserError(f"rollout.tp={self.rollout_tp} does not divide the {d.world_size} processes")
        engine = make_rollout_engine(
            name,
            path,
            device=device,
            dtype=self.rollout_dtype,
            tp=self.rollout_tp,
            mem_fraction=cfg.rollout.mem_fraction or getattr(plan, "rollout_mem_fraction", 0.0) or 0.5,
            max_model_len=cfg.rollout.max_prompt_len + cfg.rollout.max_response_len,
            seed=cfg.train.seed + d.rank,
        )
        self.ctx.log(f"rollout: {name} engine on every rank ({self.rollout_dtype})")
        return engine

    # ------------------------------------------------------------------ timing

    @contextmanager
    def timed(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.m[key] = self.m.get(key, 0.0) + time.perf_counter() - start

    # ------------------------------------------------------------------ rollout

    def _sampling(self, step: int, *, temperature: float, seed_offset: int = 0):
        """Sampling parameters with a seed of its own for each (step, rollout group)."""
        from rlctl.rollout import SamplingParams

        r, d = self.cfg.rollout, self.dist
        call = (step * (d.world_size // self.rollout_tp) + d.rank // self.rollout_tp) * 2 + seed_offset
        return SamplingParams(
            temperature=temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_response_len,
            seed=self.cfg.train.seed + call * 1_000_003,
        )

    def _group_generate(self, shares: list[list[Prompt]], n: int, sampling) -> list:
        """Samples of this rank's prompts. ``shares[i]`` are the prompts of the i-th rank of this rank's
        rollout group (``rollout.tp`` consecutive ranks): a vLLM tensor-parallel group must generate the
        same requests on all its ranks, so the group generates every share and each rank keeps its own
        (``prompt_index`` relative to its share)."""
        from dataclasses import replace

        own = self.dist.rank % self.rollout_tp
        everything = [p.token_ids for share in shares for p in share]
        samples = self.rollout.generate(everything, n, sampling) if everything else []
        start = sum(len(share) for share in shares[:own])
        return [
            replace(s, prompt_index=s.prompt_index - start)
            for s in samples
            if start <= s.prompt_index < start + len(shares[own])
        ]

    def _wake_and_sync(self) -> None:
        """Wake the rollout engine and, after an update, load the actor's weights into it."""
        if self._asleep:
            self.rollout.wake()
            self._asleep = False
        if self.weights_stale:
            from rlctl.rollout.base import torch_dtype

            with self.timed("time/weight_sync"):
                self.rollout.update_weights(self.actor.iter_full_params(dtype=torch_dtype(self.rollout_dtype)))
            self.weights_stale = False

    def _sleep(self) -> None:
        if self.rollout.supports_sleep:
            self.rollout.sleep()
            self._asleep = True

    def generate(self, step: int) -> RolloutBatch:
        """This rank's prompts of step ``step``, ``rollout.n`` samples each."""
        d, n = self.dist, self.cfg.rollout.n
        indices = self.sampler.indices(step)

        def positions_of(rank: int) -> list[int]:
            return rank_positions(len(indices), self.mini_batch_size, rank, d.world_size)

        first = d.rank - d.rank % self.rollout_tp  # this rank's rollout group: rollout.tp consecutive ranks
        shares = [[self.data.train[indices[p]] for p in positions_of(r)] for r in range(first, first + self.rollout_tp)]
        positions, prompts = positions_of(d.rank), shares[d.rank - first]
        self.m["time/weight_sync"] = 0.0  # stays 0 when the weights are current (first step, after an eval)
        self._wake_and_sync()
        with self.timed("time/rollout"):
            samples = self._group_generate(shares, n, self._sampling(step, temperature=self.cfg.rollout.temperature))
            self._sleep()
        seen: dict[int, int] = {}
        uid = []
        for s in samples:
            j = seen.get(s.prompt_index, 0)
            seen[s.prompt_index] = j + 1
            uid.append(positions[s.prompt_index] * n + j)
        return RolloutBatch.build(
            [prompts[s.prompt_index].token_ids for s in samples],
            [s.token_ids for s in samples],
            [s.logprobs for s in samples],
            uid,
            n=n,
            batch_size=len(indices),
            mini_batch_size=self.mini_batch_size,
            width=self.cfg.rollout.max_response_len,
            truncated=[s.finish_reason == "length" for s in samples],
            meta=[prompts[s.prompt_index] for s in samples],
            device=self.device,
        )

    def pool(self, batch: RolloutBatch) -> RolloutBatch:
        """The samples of every rank that splits this rank's model replica (Megatron: its TP x PP group),
        in rank order: those ranks train on them together. FSDP: the batch itself."""
        if self.actor.mp_size == 1:
            return batch
        parts = all_gather_objects(batch.to("cpu"), self.actor.mp_group)
        return RolloutBatch.join(parts).to(self.device)

    # ------------------------------------------------------------------ rewards

    def _score(
        self, prompts: list[list[int]], responses: list[list[int]], meta: list[Prompt], step: int
    ) -> tuple[torch.Tensor, dict]:
        """Scores of this rank's samples and the global reward metrics (collective): score locally,
        sum the counts over ranks, then :func:`rlctl.rewards.reward_metrics`."""
        from rlctl.rewards import reward_metrics, reward_warning

        result = self.rewards.score(self.rewards.batch(prompts, responses, meta))
        keys = sorted({k for ks in all_gather_objects(sorted(result.sums)) for k in ks})
        sums = global_sums({k: result.sums.get(k, 0.0) for k in keys}, self.device)
        out = reward_metrics(sums, result.errors)  # UserError when every sample failed
        warning = reward_warning(sums, result.errors, step)
        if warning:
            self.ctx.log(warning)
        return torch.tensor(result.scores, dtype=torch.float32, device=self.device), out

    def score(self, batch: RolloutBatch, step: int) -> None:
        """Score this rank's samples (before :meth:`pool`, so sums run over every rank); reward and
        response-length metrics."""
        batch.scores, metrics = self._score(batch.prompts, batch.responses, batch.meta, step)
        self.m.update(metrics)
        for key in ("reward/failed", "reward/nonfinite"):  # run totals, for summary.json
            self.reward_totals[key] = self.reward_totals.get(key, 0) + int(metrics[key])
        lengths = batch.mask.sum(-1)
        s = global_sums(
            {
                "len": lengths.sum(),
                "trunc": batch.truncated.sum(),
                "n": len(batch),
                "prompt": sum(len(p) for p in batch.prompts),
            },
            self.device,
        )
        self.m["response_len/mean"] = s["len"] / max(1.0, s["n"])
        self.m["response_len/max"] = float(all_reduce_max(int(lengths.max()) if len(batch) else 0, self.device))
        self.m["response/truncated"] = s["trunc"] / max(1.0, s["n"])
        self.m["tokens"] = s["len"] + s["prompt"]

    # ------------------------------------------------------------------ log-prob passes

    def ref_logprobs(self, batch: RolloutBatch) -> None:
        with self.timed("time/logprobs"):
            batch.ref_logp, _ = compute_logprobs(
                self.ref, batch, temperature=self.temperature, budget=self.budget, pad_id=self.pad_id
            )

    def old_logprobs(self, batch: RolloutBatch) -> None:
        """The actor's log-probs before the update; compared with the rollout engine's."""
        with self.timed("time/logprobs"):
            batch.old_logp, entropy = compute_logprobs(
                self.actor,
                batch,
                temperature=self.temperature,
                budget=self.budget,
                pad_id=self.pad_id,
                with_entropy=True,
            )
        mask = batch.mask
        s = global_sums(
            {
                "diff": ((batch.old_logp - batch.rollout_logp).abs() * mask).sum(),
                "ent": (entropy * mask).sum(),
                "tok": mask.sum(),
            },
            self.device,
            self.dp_group,
        )
        tokens = max(1.0, s["tok"])
        self.m["rollout/logprob_diff"] = s["diff"] / tokens
        self.m["entropy"] = s["ent"] / tokens
        if self.m["rollout/logprob_diff"] > LOGPROB_DIFF_WARN:
            self.ctx.log(
                f"warning: the rollout engine's log-probs differ from the trainer's by "
                f"{self.m['rollout/logprob_diff']:.3g} per token on average (weights out of sync, "
                f"or a precision mismatch)"
            )

    def values(self, batch: RolloutBatch) -> None:
        with self.timed("time/logprobs"):
            batch.values = compute_values(self.critic, batch, budget=self.budget, pad_id=self.pad_id)

    # ------------------------------------------------------------------ advantages

    def advantages(self, batch: RolloutBatch) -> None:
        """Token rewards (minus the KL penalty when algo.kl_in_reward), then algo.adv on the global batch."""
        a = self.cfg.algo
        kl = None
        if batch.ref_logp is not None:
            kl = kl_estimate(batch.old_logp, batch.ref_logp, a.kl_kind) * batch.mask
            s = global_sums({"kl": kl.sum(), "tok": batch.mask.sum()}, self.device, self.dp_group)
            self.m["kl"] = s["kl"] / max(1.0, s["tok"])
        coef = self.kl_ctl.value if a.kl_in_reward and kl is not None else 0.0
        rewards = token_rewards(batch, coef, kl)
        batch.advantages, batch.returns = compute_advantages(batch, self.cfg, rewards, self.dp_group)
        if coef:
            self.m["kl_coef"] = coef
            self.kl_ctl.update(self.m["kl"], batch.total)

    # ------------------------------------------------------------------ updates

    def update_actor(self, batch: RolloutBatch) -> None:
        a = self.cfg.algo
        kl_loss_coef = a.kl_coef if self.ref is not None and not a.kl_in_reward else 0.0
        with self.timed("time/update"):
            self.m.update(
                update_actor(
                    self.actor, batch, self.cfg, budget=self.budget, pad_id=self.pad_id, kl_loss_coef=kl_loss_coef
                )
            )
        self.weights_stale = True

    def update_critic(self, batch: RolloutBatch) -> None:
        with self.timed("time/update"):
            self.m.update(update_critic(self.critic, batch, self.cfg, budget=self.budget, pad_id=self.pad_id))

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, step: int) -> dict:
        """Mean reward on the validation prompts (rollout.val_n samples at rollout.val_temperature)."""
        r, d, tp = self.cfg.rollout, self.dist, self.rollout_tp
        group_prompts = self.data.val[d.rank // tp :: d.world_size // tp]
        shares = [group_prompts[i::tp] for i in range(tp)]
        mine = shares[d.rank % tp]
        began = time.perf_counter()
        self._wake_and_sync()
        samples = self._group_generate(
            shares, r.val_n, self._sampling(step, temperature=r.val_temperature, seed_offset=1)
        )
        self._sleep()
        picked = [mine[s.prompt_index] for s in samples]
        _, metrics = self._score([p.token_ids for p in picked], [s.token_ids for s in samples], picked, step)
        out = {
            "step": step,
            "kind": "eval",
            "val/reward/mean": metrics["reward/mean"],
            "time/eval": time.perf_counter() - began,
        }
        if "acc" in metrics:
            out["val/acc"] = metrics["acc"]
        return out

    # ------------------------------------------------------------------ checkpoints

    def _engines(self) -> dict[str, TrainEngine]:
        return {"": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def checkpoint(self, step: int):
        state = {
            "method": self.cfg.method,
            "epoch": self.sampler.epoch_of(step),
            "total_steps": self.total_steps,
            "kl_coef": self.kl_ctl.value,
            "data": {
                "num_prompts": len(self.data.train),
                "batch_size": self.sampler.batch_size,
                "steps_per_epoch": self.sampler.steps_per_epoch,
                "seed": self.cfg.train.seed,
            },
        }
        return save_checkpoint(
            self.ctx.paths.checkpoints,
            step,
            self._engines(),
            trainer_state=state,
            meta_dir=self.ctx.paths.model_meta,
            rng_state=rng_state(),
            keep_last=self.cfg.checkpoint.keep_last,
        )

    def resume(self) -> int:
        """Load ``checkpoint.resume`` when set; return the step to start from."""
        cfg, ctx = self.cfg, self.ctx
        path = resolve_resume(cfg.checkpoint.resume, ctx.paths.root)
        if path is None:
            if cfg.checkpoint.resume == "auto":
                ctx.log("resume=auto: no checkpoint found, starting from step 0")
            return 0
        state, rng = load_checkpoint(path, self._engines())
        if state.get("method") != cfg.method:
            raise UserError(f"{path} was saved by `rlctl {state.get('method')}`; resume it with that command")
        if rng is not None:
            set_rng_state(rng)
        self.kl_ctl.value = float(state.get("kl_coef", self.kl_ctl.value))
        if state.get("data", {}).get("num_prompts") != len(self.data.train):
            ctx.log(
                f"warning: the data changed since {path.name} (prompts {state.get('data', {}).get('num_prompts')}"
                f" -> {len(self.data.train)}); the prompt order differs"
            )
        self.weights_stale = True
        ctx.log(
            f"resumed from {path} at step {state['step']} (saved by {state.get('world_size')} processes, "
            f"now {self.dist.world_size})"
        )
        return int(state["step"])

    # ------------------------------------------------------------------ the loop

    def fit(self, train_step: Callable[[RLTrainer, int], None]) -> None:
        """Run ``train_step`` for every step, with metrics, evaluation, checkpoints, stop requests,
        and at the end the final checkpoint, the HF export and summary.json."""
        cfg, ctx, paths = self.cfg, self.ctx, self.ctx.paths
        start = self.resume()
        metrics = MetricsLogger(
            paths.metrics,
            backends=cfg.log.backends,
            enabled=self.dist.is_main,
            project=cfg.log.project,
            run_name=cfg.log.run_name,
            config=cfg.to_dict(),
        )
        saved, interrupted, step = None, False, start
        evaluate = bool(self.data.val and cfg.train.eval_every)
        while step < self.total_steps:
            self.m = {}
            lr = self.actor.lr
            began = time.perf_counter()
            train_step(self, step)
            elapsed = time.perf_counter() - began
            step += 1
            record = {
                "step": step,
                "total_steps": self.total_steps,
                "reward": self.m["reward/mean"],
                **{k: self.m[k] for k in sorted(self.m)},
                "lr": lr,
                "epoch": round(step / self.sampler.steps_per_epoch, 4),
                "time/step": elapsed,
                "tokens_per_s": self.m.get("tokens", 0.0) / elapsed,
            }
            if step % cfg.log.every == 0 or step == self.total_steps:
                metrics.log(record)
            if evaluate and step % cfg.train.eval_every == 0:
                metrics.log(self.evaluate(step))
            (stop_votes,) = all_reduce_sum([float(ctx.stop.local(step))], self.device)
            if stop_votes > 0 and step < self.total_steps:
                interrupted = True
                saved = self.checkpoint(step)
                ctx.log(f"stopped at step {step}; checkpoint {saved}")
                break
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < self.total_steps:
                saved = self.checkpoint(step)

        hf_dir = None
        if not interrupted:
            if evaluate and step % cfg.train.eval_every:
                metrics.log(self.evaluate(step))
            if saved is None or saved.name != f"step_{step:06d}":
                saved = self.checkpoint(step)
            if cfg.checkpoint.export_hf:
                from rlctl.formats.hf_writer import config_dtype

                dtype = config_dtype(json.loads((paths.model_meta / "config.json").read_text()))
                hf_dir = self.actor.export_hf(paths.hf, paths.model_meta, dtype=dtype)
        metrics.close()
        self.rollout.close()
        self.rewards.close()
        if self.dist.is_main:
            write_json_atomic(
                paths.summary,
                {
                    "status": "interrupted" if interrupted else "completed",
                    "step": step,
                    "total_steps": self.total_steps,
                    "checkpoint": str(saved) if saved else None,
                    "hf": str(hf_dir) if hf_dir else None,
                    "data": self.data.report.to_dict(),
                    "prompts_too_long": self.data.too_long,
                    "rewards": self.reward_totals,  # reward/failed and reward/nonfinite samples over the run
                },
            )
