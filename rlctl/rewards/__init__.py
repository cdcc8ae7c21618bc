"""Reward functions (verl-compatible) and how rlctl finds and runs them.

A reward function has verl's signature
``fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`` (a dict carries
its score under ``"score"`` and may add numeric metrics). Built-ins: :mod:`rlctl.rewards.builtin`;
custom ones are named ``path/to/file.py:fn`` or ``package.module:fn``. See ``docs/rewards.md``.
"""

from rlctl.rewards.builtin import BUILTINS
from rlctl.rewards.loader import RewardFn, default_for_data_source, get_reward
from rlctl.rewards.scoring import score_batch

__all__ = ["BUILTINS", "RewardFn", "default_for_data_source", "get_reward", "score_batch"]
