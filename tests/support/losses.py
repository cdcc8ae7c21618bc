"""The context a test hands a policy loss, with that loss's registered defaults (what its keyword defaults
were before the losses took one :class:`rlctl.algos.losses.PolicyLossContext`)."""

from __future__ import annotations

from rlctl.algos.losses import PolicyLossContext
from rlctl.algos.registry import get_policy_loss


def loss_ctx(name: str, logp, old_logp, advantages, mask, **settings) -> PolicyLossContext:
    """``settings`` (clip_low, agg, is_weights, global_seqs...) over the loss ``name``'s defaults."""
    d = get_policy_loss(name)
    defaults = {"clip_low": d.clip_low, "clip_high": d.clip_high, "dual_clip": d.dual_clip, "agg": d.agg}
    return PolicyLossContext(logp, old_logp, advantages, mask, **{**defaults, **settings})
