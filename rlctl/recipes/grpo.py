"""GRPO on the plan's engine (FSDP2 or Megatron): ``python -m rlctl.recipes.grpo --run-dir RUN`` (under torchrun).

No critic: each prompt gets ``rollout.n`` samples and a sample's advantage is its reward compared
with its group's (``algo.adv``: grpo, rloo or reinforce_pp). The KL to the frozen reference policy
is a loss term (``pg + kl_coef * agg(kl)``) unless ``algo.kl_in_reward``. The policy loss is the
one ``algo.policy_loss`` names (ppo or gspo, each with its own clip range and aggregation). The
shared machinery (batches, packing, global denominators, weight sync) is in :mod:`rlctl.recipes.rl`;
the loop around the steps (resume, eval, checkpoints, export) is :func:`rlctl.runtime.fit.fit`.
"""

from __future__ import annotations

from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.recipes.rl.metrics import Metrics, merged
from rlctl.recipes.rl.offpolicy import rollout_main
from rlctl.recipes.rl.streaming import stream_rollout_main
from rlctl.recipes.rl.trainer import RLTrainer
from rlctl.runtime.entry import RunContext, recipe_main
from rlctl.runtime.fit import fit


def train_step(rl: RLTrainer, step: int) -> tuple[RolloutBatch, Metrics]:
    """One GRPO step: its batch and its metrics."""
    # this rank's prompts, n samples each, scored (weights synced after the last update; dynamic sampling:
    # more rounds until the groups whose scores differ fill the batch)
    batch, sampled = rl.sample(step)
    batch = rl.pool(batch)  # the ranks of one model replica (Megatron TP x PP) train on their samples together
    ref = rl.ref_logprobs(batch) if rl.ref is not None else {}  # frozen reference policy, for the KL term
    old = rl.old_logprobs(batch)  # the actor before the update (+ rollout/logprob_diff)
    advantages = rl.advantages(batch)  # group-relative advantages on the global batch
    update = rl.update_actor(batch)  # ppo_epochs x mini-batches of clipped policy-gradient steps
    return batch, merged(sampled, ref, old, advantages, update)


def run(ctx: RunContext) -> None:
    if ctx.dist.split is not None and ctx.dist.split.role == "rollout":
        # a rollout process of a split run (rollout.procs): the fixed schedule, or streaming (docs/async.md)
        return (stream_rollout_main if ctx.cfg.rollout.mode == "stream" else rollout_main)(ctx)
    fit(ctx, RLTrainer(ctx, train_step, with_critic=False))


if __name__ == "__main__":
    recipe_main(run)
