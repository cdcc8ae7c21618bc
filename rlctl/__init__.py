"""rlctl: opinionated post-training (SFT, GRPO, PPO) for LLMs from the command line."""

__version__ = "0.1.0"
