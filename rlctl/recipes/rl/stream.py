"""The prompts of an RL run in order: :class:`PromptStream`, the step sampler and the data position.

A step's batch is fixed by the step number (:class:`rlctl.data.packing.StepSampler`); dynamic sampling
draws more from the same stream of examples, so the position (examples drawn so far) is what a
checkpoint saves. The trainer and the rollout processes of a split run build it alike, and read the
run's step count and mini-batch size here."""

from __future__ import annotations

import math

from rlctl.config import RunConfig, total_steps
from rlctl.data.packing import StepSampler


class PromptStream:
    """The sampler of a run's ``num_examples`` training prompts and the position drawn to so far."""

    def __init__(self, cfg: RunConfig, num_examples: int):
        t = cfg.train
        self.sampler = StepSampler(num_examples, t.batch_size, seed=t.seed, shuffle=cfg.data.shuffle)
        self.batch_size = self.sampler.batch_size  # train.batch_size, or every example when there are fewer
        self.steps_per_epoch = self.sampler.steps_per_epoch
        self.total_steps = total_steps(cfg, self.steps_per_epoch)
        # prompts per optimizer step (algo.mini_batch_size, resolved by the plan; 0: the whole batch)
        self.mini_batch_size = min(cfg.algo.mini_batch_size or self.batch_size, self.batch_size)
        self.cursor = 0  # examples drawn so far (the stream's position)

    def optimizer_steps(self, ppo_epochs: int) -> int:
        """The optimizer steps of the whole run (the learning-rate schedule's length)."""
        return self.total_steps * ppo_epochs * math.ceil(self.batch_size / self.mini_batch_size)

    def step(self, step: int) -> list[int]:
        """Step ``step``'s batch; the position moves to the next step's."""
        indices = self.sampler.indices(step)
        self.cursor = self.sampler.first(step + 1)
        return indices

    def draw(self, count: int) -> tuple[list[int], int]:
        """The next ``count`` examples and the position they start at; the position moves past them."""
        start = self.cursor
        self.cursor += count
        return self.sampler.stream(start, count), start

    def restore(self, position: int | None, step: int) -> None:
        """The position a checkpoint saved (None, older checkpoints: one batch a step up to ``step``)."""
        self.cursor = int(position if position is not None else self.sampler.first(step))
