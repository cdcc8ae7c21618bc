"""Reward functions (verl-compatible), and the one place that scores RL samples.

A reward function has verl's signature
``fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`` (a dict carries
its score under ``"score"`` and may add numeric metrics), or verl's batch form (lists in, a list
out); a reward class is constructed once with the tokenizer and called with a :class:`RewardBatch`.
Built-ins: :mod:`rlctl.rewards.builtin`; custom ones are named ``path/to/file.py:fn`` or
``package.module:fn``. :class:`RewardManager` combines weighted components and a reward model;
:func:`reward_metrics` turns the summed counts into metrics. See ``docs/rewards.md``.
"""

from rlctl.rewards.builtin import BUILTINS
from rlctl.rewards.loader import RewardFn, default_for_data_source, get_reward
from rlctl.rewards.manager import (
    RewardBatch,
    RewardManager,
    RewardResult,
    classify,
    reward_metrics,
    reward_warning,
)
from rlctl.rewards.scoring import score_batch
from rlctl.rewards.spec import RewardSpec, check_reward_config, needs_answer, parse_spec, reward_specs

__all__ = [
    "BUILTINS",
    "RewardBatch",
    "RewardFn",
    "RewardManager",
    "RewardResult",
    "RewardSpec",
    "check_reward_config",
    "classify",
    "default_for_data_source",
    "get_reward",
    "needs_answer",
    "parse_spec",
    "reward_metrics",
    "reward_specs",
    "reward_warning",
    "score_batch",
]
