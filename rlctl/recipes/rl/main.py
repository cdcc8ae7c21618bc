"""The one step and the one entry of GRPO and PPO: :func:`rl_main` on every rank of ``rlctl.recipes.grpo`` /
``rlctl.recipes.ppo`` (:func:`rlctl.runtime.entry.recipe_main` runs it). What differs between the two methods
is data, :data:`METHODS`: whether a critic is trained (its preset is ``presets/<method>.yaml``, merged before
launch); the step reads the trainer's parts and runs the passes they call for."""

from __future__ import annotations

from dataclasses import dataclass

from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.recipes.rl.inputs import build_inputs
from rlctl.recipes.rl.metrics import Metrics, merged
from rlctl.recipes.rl.offpolicy import rollout_main
from rlctl.recipes.rl.streaming import stream_rollout_main
from rlctl.recipes.rl.trainer import RLTrainer
from rlctl.runtime.entry import RunContext
from rlctl.runtime.fit import fit


@dataclass(frozen=True)
class RLMethod:
    with_critic: bool  # PPO: a value model, GAE advantages; GRPO: group-relative advantages, no critic


METHODS = {"grpo": RLMethod(with_critic=False), "ppo": RLMethod(with_critic=True)}


def rl_step(rl: RLTrainer, step: int) -> tuple[RolloutBatch, Metrics]:
    """One GRPO or PPO step: its batch and its metrics."""
    index = rl.teacher_data_index(step)
    if index is not None:  # GKD's mixture: this step trains on the teacher's own responses
        return teacher_data_step(rl, index)
    # this rank's prompts, n samples each, scored (weights synced after the last update; dynamic sampling:
    # more rounds until the groups whose scores differ fill the batch)
    batch, sampled = rl.sample(step)
    batch = rl.pool(batch)  # the ranks of one model replica (Megatron TP x PP) train on their samples together
    ref = rl.ref_logprobs(batch) if rl.ref is not None else {}  # frozen reference policy, for the KL term
    old = rl.old_logprobs(batch)  # the actor before the update (+ rollout/logprob_diff)
    critic = rl.critic is not None
    values = rl.values(batch) if critic else {}  # PPO: the critic's values of the states before each token
    advantages = rl.advantages(batch)  # algo.adv on the global batch (PPO: GAE over KL-penalised token rewards)
    critic_update = rl.update_critic(batch) if critic else {}  # PPO: clipped value loss on the returns
    actor = {}
    if not critic or step >= rl.algo.critic_warmup:  # PPO trains only the critic for algo.critic_warmup steps
        actor = rl.update_actor(batch)  # ppo_epochs x mini-batches of clipped policy-gradient steps
    return batch, merged(sampled, ref, old, values, advantages, critic_update, actor)


def teacher_data_step(rl: RLTrainer, index: int) -> tuple[RolloutBatch, Metrics]:
    """A step on ``--teacher-data``'s rows (the ``index``-th such step; docs/distill.md): nothing is sampled or
    scored, the advantages are 0, and the full-vocabulary loss to the teacher trains the actor on them."""
    batch, rows = rl.teacher_rows(index)
    batch = rl.pool(batch)
    ref = rl.ref_logprobs(batch) if rl.ref is not None else {}  # the KL term reads them on these rows too
    old = rl.old_logprobs(batch, sampled=False)  # the actor's, also as the rows' behaviour log-probs
    actor = rl.update_actor(batch)
    return batch, merged({"distill/teacher_data": 1.0}, rows, ref, old, actor)


def rl_main(ctx: RunContext) -> None:
    """A rank of a GRPO or PPO run: a trainer under :func:`rlctl.runtime.fit.fit`, or a split run's rollout
    process (``rollout.procs``, :mod:`rlctl.recipes.rl.offpolicy`)."""
    if ctx.dist.split is not None and ctx.dist.split.role == "rollout":
        # the fixed schedule, or streaming (docs/async.md); the trainers log the data
        roll = stream_rollout_main if ctx.cfg.rollout.mode == "stream" else rollout_main
        return roll(ctx, lambda: build_inputs(ctx, log=lambda _: None))
    inputs = build_inputs(ctx, ctx.log)  # model source, tokenizer, tools, data, stream, rollout spec
    fit(ctx, RLTrainer(ctx, inputs, rl_step, with_critic=METHODS[ctx.cfg.method].with_critic))
