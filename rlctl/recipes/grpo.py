"""GRPO on the plan's engine (FSDP2 or Megatron): ``python -m rlctl.recipes.grpo --run-dir RUN`` (under torchrun).

No critic: each prompt gets ``rollout.n`` samples and a sample's advantage is its reward compared
with its group's (``algo.adv``: grpo, rloo or reinforce_pp). The KL to the frozen reference policy
is a loss term (``pg + kl_coef * agg(kl)``) unless ``algo.kl_in_reward``. The policy loss is the
one ``algo.policy_loss`` names (ppo or gspo, each with its own clip range and aggregation). The
shared machinery (batches, packing, global denominators, weight sync) is in :mod:`rlctl.recipes.rl`;
its step and entry are :func:`rlctl.recipes.rl.main.rl_main`'s, shared with
PPO (the loop around the steps: :func:`rlctl.runtime.fit.fit`).
"""

from __future__ import annotations

from rlctl.recipes.rl.main import rl_main
from rlctl.runtime.entry import recipe_main

if __name__ == "__main__":
    recipe_main(rl_main)
