"""What the RL algorithm is: :class:`AlgoSpec`, read once from the resolved run config.

The trainer, the advantage step and the update read these typed fields, never ``cfg.algo``: the
advantage estimator and its constants, the policy loss with its resolved clip range and aggregation
(:func:`rlctl.algos.resolve_policy_loss`: the user's keys, else the loss's own defaults), the PPO epochs
and mini-batches, the KL term, the critic's settings, and the two rollout settings the losses need.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from rlctl.algos import resolve_policy_loss
from rlctl.algos.correction import Correction, correction_for
from rlctl.algos.registry import PolicyLossSettings
from rlctl.config import RunConfig


@dataclass(frozen=True)
class AlgoSpec:
    """The algorithm of a GRPO / PPO run (``algo.*``, plus ``rollout.temperature`` and
    ``rollout.max_response_len``)."""

    adv: str  # the advantage estimator's registered name (grpo | rloo | reinforce_pp | gae | a plugin's)
    norm_by_std: bool
    gamma: float
    lam: float
    policy: PolicyLossSettings  # the policy loss and the clip range / aggregation that reach it
    ppo_epochs: int
    mini_batch_size: int  # prompts per optimizer step (0: the whole batch)
    kl_coef: float
    kl_kind: str
    kl_in_reward: bool
    kl_target: float  # > 0: the adaptive KL controller
    entropy_coef: float
    critic_lr: float
    vf_clip: float  # 0: no value clipping
    critic_warmup: int  # PPO: steps that train the critic only
    temperature: float  # the log-probs' temperature: the sampling one (0, greedy, counts as 1)
    norm_len: int  # rollout.max_response_len: the constant of seq-mean-token-sum-norm
    correction: Correction | None = None  # rollout-mismatch importance weights (None: off)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> AlgoSpec:
        a, policy = cfg.algo, policy_settings(cfg)
        return cls(
            adv=a.adv,
            norm_by_std=a.norm_by_std,
            gamma=a.gamma,
            lam=a.lam,
            policy=policy,
            ppo_epochs=a.ppo_epochs,
            mini_batch_size=a.mini_batch_size,
            kl_coef=a.kl_coef,
            kl_kind=a.kl_kind,
            kl_in_reward=a.kl_in_reward,
            kl_target=a.kl_target,
            entropy_coef=a.entropy_coef,
            critic_lr=a.critic_lr,
            vf_clip=a.vf_clip,
            critic_warmup=a.critic_warmup,
            temperature=cfg.rollout.temperature or 1.0,
            norm_len=cfg.rollout.max_response_len,
            correction=correction_for(
                a.rollout_correction,
                cfg.rollout.engine,
                level=a.correction_level,
                upper=a.correction_threshold,
                lower=a.correction_lower,
                reject=a.correction_reject,
                off_policy=cfg.rollout.procs > 0 and cfg.rollout.max_staleness > 0,  # rlctl.recipes.rl.offpolicy
                loss_weighs_behaviour=policy.loss.weighs_behaviour,
            ),
        )

    def replace(self, **changes) -> AlgoSpec:
        return dataclasses.replace(self, **changes)


def policy_settings(cfg: RunConfig) -> PolicyLossSettings:
    """The policy loss ``algo.policy_loss`` names, with the keys the user set and its own defaults."""
    a = cfg.algo
    knobs = {"cap": a.decoupled_cap} if a.policy_loss == "decoupled" else {}  # the config keys of a loss's knobs
    return resolve_policy_loss(
        a.policy_loss, clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip, agg=a.loss_agg, knobs=knobs
    )
