"""RL math for the trainers: small pure torch functions, no distributed code.

- :mod:`rlctl.algos.advantages`: GRPO, RLOO, REINFORCE++, GAE; :mod:`rlctl.algos.estimators`: the same
  in the registry's signature on the global batch.
- :mod:`rlctl.algos.losses`: loss aggregation (with the data-parallel contract), the context every policy
  loss receives (``PolicyLossContext``), PPO / GSPO policy losses, clipped value loss.
- :mod:`rlctl.algos.correction`: rollout-mismatch importance weights (TIS / MIS, rejection, metrics).
- :mod:`rlctl.algos.kl`: KL estimators, KL coefficient controllers, entropy.
- :mod:`rlctl.algos.logprobs`: chosen-token log-probabilities from logits, memory-aware.
- :mod:`rlctl.algos.masked`: masked mean / variance / whitening.
- :mod:`rlctl.algos.registry`: advantage estimators and policy losses by name, each loss with its own
  defaults (``register_adv_est``, ``register_policy_loss``, ``resolve_policy_loss``); no torch.

The names below are imported on first use, so ``rlctl.algos.registry`` (which the CLI reads to check a
config) does not import torch. Formulas, defaults and references: ``docs/algos.md``.
"""

from __future__ import annotations

import importlib
from typing import Any

_FROM = {
    "advantages": ("gae", "grpo", "reinforce_pp", "rloo"),
    "correction": ("is_weights",),
    "kl": ("KL_KINDS", "AdaptiveKLController", "FixedKLController", "entropy_from_logits", "kl_estimate"),
    "logprobs": ("logprobs_from_logits",),
    "losses": ("AGG_MODES", "PolicyLossContext", "aggregate", "gspo_policy_loss", "ppo_policy_loss", "value_loss"),
    "masked": ("masked_mean", "masked_sum", "masked_var", "masked_whiten"),
    "registry": (
        "ADV_ESTIMATORS",
        "POLICY_LOSSES",
        "get_adv_estimator",
        "get_policy_loss",
        "register_adv_est",
        "register_policy_loss",
        "resolve_policy_loss",
    ),
}
_MODULE_OF = {name: module for module, names in _FROM.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'rlctl.algos' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rlctl.algos.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
