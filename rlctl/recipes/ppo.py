"""PPO with a critic: ``python -m rlctl.recipes.ppo --run-dir RUN`` (under torchrun).

A second engine holds the critic: the policy's backbone plus a scalar value head, its own optimizer
at ``algo.critic_lr`` (FSDP2 only: the Megatron engine does not run a critic yet, so the planner
does not choose it for ppo). Advantages come from GAE over per-token rewards: the score on the
last response token minus ``kl_coef * KL`` on every token (``algo.kl_in_reward``; adaptive towards
``algo.kl_target`` when set). The critic learns the returns with a clipped value loss; for the first
``algo.critic_warmup`` steps only the critic is trained. Shared machinery: :mod:`rlctl.recipes.rl`;
the loop around the steps (resume, eval, checkpoints, export) is :func:`rlctl.runtime.fit.fit`.
"""

from __future__ import annotations

from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.recipes.rl.metrics import Metrics, merged
from rlctl.recipes.rl.offpolicy import rollout_main
from rlctl.recipes.rl.trainer import RLTrainer
from rlctl.runtime.entry import RunContext, recipe_main
from rlctl.runtime.fit import fit


def train_step(rl: RLTrainer, step: int) -> tuple[RolloutBatch, Metrics]:
    """One PPO step: its batch and its metrics."""
    # this rank's prompts, n samples each, scored (weights synced after the last update; dynamic sampling:
    # more rounds until the groups whose scores differ fill the batch)
    batch, sampled = rl.sample(step)
    batch = rl.pool(batch)  # the ranks of one model replica (Megatron TP x PP) train on their samples together
    ref = rl.ref_logprobs(batch) if rl.ref is not None else {}  # frozen reference policy, for the KL penalty
    old = rl.old_logprobs(batch)  # the actor before the update (+ rollout/logprob_diff)
    values = rl.values(batch)  # the critic's values of the states before each response token
    advantages = rl.advantages(batch)  # KL-penalised token rewards -> GAE advantages and returns
    critic = rl.update_critic(batch)  # clipped value loss on the returns
    actor = {}
    if step >= rl.algo.critic_warmup:
        actor = rl.update_actor(batch)  # ppo_epochs x mini-batches of clipped policy-gradient steps
    return batch, merged(sampled, ref, old, values, advantages, critic, actor)


def run(ctx: RunContext) -> None:
    if ctx.dist.split is not None and ctx.dist.split.role == "rollout":
        return rollout_main(ctx)  # a rollout process of a split run (rollout.procs)
    fit(ctx, RLTrainer(ctx, train_step, with_critic=True))


if __name__ == "__main__":
    recipe_main(run)
