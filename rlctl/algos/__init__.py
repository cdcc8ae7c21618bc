"""RL math for the trainers: small pure torch functions, no distributed code.

- :mod:`rlctl.algos.advantages`: GRPO, RLOO, REINFORCE++, GAE.
- :mod:`rlctl.algos.losses`: loss aggregation (with the data-parallel contract), PPO / GSPO policy
  losses, clipped value loss.
- :mod:`rlctl.algos.kl`: KL estimators, KL coefficient controllers, entropy.
- :mod:`rlctl.algos.logprobs`: chosen-token log-probabilities from logits, memory-aware.
- :mod:`rlctl.algos.masked`: masked mean / variance / whitening.
- :mod:`rlctl.algos.registry`: advantage estimators and policy losses by name, each loss with its own
  defaults (``register_adv_est``, ``register_policy_loss``, ``resolve_policy_loss``).

Formulas, defaults and references: ``docs/algos.md``.
"""

from rlctl.algos.advantages import gae, grpo, reinforce_pp, rloo
from rlctl.algos.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    kl_estimate,
)
from rlctl.algos.logprobs import logprobs_from_logits
from rlctl.algos.losses import AGG_MODES, aggregate, gspo_policy_loss, ppo_policy_loss, value_loss
from rlctl.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from rlctl.algos.registry import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    get_adv_estimator,
    get_policy_loss,
    register_adv_est,
    register_policy_loss,
    resolve_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_KINDS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "entropy_from_logits",
    "gae",
    "get_adv_estimator",
    "get_policy_loss",
    "grpo",
    "gspo_policy_loss",
    "kl_estimate",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_policy_loss",
    "register_adv_est",
    "register_policy_loss",
    "reinforce_pp",
    "resolve_policy_loss",
    "rloo",
    "value_loss",
]
