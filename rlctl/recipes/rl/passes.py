"""Forward passes over a step's samples: the log-probs of the sampled tokens (and their entropy) under
an engine, and the critic's values. Samples are packed into micro-batches under the token budget."""

from __future__ import annotations

import torch

from rlctl.algos import logprobs_from_logits
from rlctl.engines.base import TrainEngine, response_tokens
from rlctl.recipes.rl.batch import RolloutBatch, can_share_prefix, micro_batches


def compute_logprobs(
    engine: TrainEngine,
    batch: RolloutBatch,
    *,
    temperature: float,
    budget: int,
    pad_id: int,
    with_entropy: bool = False,
    share_prefix: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [b, W] of the sampled tokens under ``engine`` (and the per-token entropy when asked).
    ``share_prefix`` (default: where the engine and the batch allow it) forwards each prompt once per group."""

    def per_token(logits, mb):
        # at the positions that predict response tokens; with the entropy: one log-softmax for both
        out = response_tokens(
            logits, mb, lambda sel, labels: logprobs_from_logits(sel, labels, temperature, with_entropy=with_entropy)
        )
        return None, dict(zip(("logp", "entropy"), (x.float() for x in out)))

    if share_prefix is None:
        share_prefix = engine.shares_prefix and can_share_prefix(batch)
    micro = micro_batches(
        batch,
        list(range(len(batch))),
        budget=budget,
        pad_id=pad_id,
        device=batch.mask.device,
        share_prefix=share_prefix,
    )
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
