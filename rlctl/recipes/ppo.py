"""PPO with a critic: ``python -m rlctl.recipes.ppo --run-dir RUN`` (under torchrun).

A second engine holds the critic: the policy's backbone plus a scalar value head, its own optimizer
at ``algo.critic_lr`` (FSDP2 only: the Megatron engine does not run a critic yet, so the planner
does not choose it for ppo). Advantages come from GAE over per-token rewards: the score on the
last response token minus ``kl_coef * KL`` on every token (``algo.kl_in_reward``; adaptive towards
``algo.kl_target`` when set). The critic learns the returns with a clipped value loss; for the first
``algo.critic_warmup`` steps only the critic is trained. Shared machinery: :mod:`rlctl.recipes.rl`;
its step and entry are :func:`rlctl.recipes.rl.main.rl_main`'s, shared with
GRPO (the loop around the steps: :func:`rlctl.runtime.fit.fit`).
"""

from __future__ import annotations

from rlctl.recipes.rl.main import rl_main
from rlctl.runtime.entry import recipe_main

if __name__ == "__main__":
    recipe_main(rl_main)
