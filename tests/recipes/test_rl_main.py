"""The one GRPO / PPO step (rlctl.recipes.rl.main.rl_step): the passes each method ran in its own recipe
before they shared it, in the same order: GRPO without a critic, PPO with one, the actor left alone during
``algo.critic_warmup``. The trainer is a recorder (FAKE: the passes themselves are covered by the
pinned runs, tests/support/scripts/pinned_runs.py, and the recipe tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlctl.recipes.rl.main import METHODS, rl_step


class Recorder:  # FAKE: an RLTrainer that records which step ran
    def __init__(self, *, critic: bool, ref: bool, warmup: int = 0, teacher_step: int | None = None):
        self.calls: list[str] = []
        self.teacher_step = teacher_step  # the step that reads --teacher-data's rows (None: none)
        self.critic = object() if critic else None
        self.ref = object() if ref else None
        self.algo = SimpleNamespace(critic_warmup=warmup)

    def sample(self, step):
        self.calls.append("sample")
        return "batch", {"reward/mean": 1.0}

    def teacher_data_index(self, step):
        return 0 if step == self.teacher_step else None

    def teacher_rows(self, index):
        self.calls.append("teacher_rows")
        return "rows", {"tokens": 1.0}

    def old_logprobs(self, batch, sampled=True):
        self.calls.append("old_logprobs" if sampled else "old_logprobs(teacher rows)")
        return {"old_logprobs": 1.0}

    def pool(self, batch):
        self.calls.append("pool")
        return batch

    def __getattr__(self, name):
        def step(batch):
            self.calls.append(name)
            return {name: 1.0}

        return step


GRPO = ["sample", "pool", "old_logprobs", "advantages", "update_actor"]
PPO = ["sample", "pool", "old_logprobs", "values", "advantages", "update_critic", "update_actor"]


@pytest.mark.parametrize(
    "critic, ref, warmup, step, expected",
    [
        (False, False, 0, 0, GRPO),
        (False, True, 0, 0, GRPO[:2] + ["ref_logprobs"] + GRPO[2:]),
        (False, False, 3, 0, GRPO),  # critic_warmup means nothing without a critic
        (True, True, 0, 0, PPO[:2] + ["ref_logprobs"] + PPO[2:]),
        (True, False, 2, 1, PPO[:-1]),  # warming up: the critic only
        (True, False, 2, 2, PPO),
    ],
)
def test_one_step_runs_each_methods_passes_in_order(critic, ref, warmup, step, expected):
    rl = Recorder(critic=critic, ref=ref, warmup=warmup)
    batch, metrics = rl_step(rl, step)
    assert rl.calls == expected and batch == "batch"
    assert set(metrics) == {"reward/mean"} | set(expected[2:])


def test_the_methods_differ_by_the_critic_only():
    assert {name: m.with_critic for name, m in METHODS.items()} == {"grpo": False, "ppo": True}


@pytest.mark.parametrize("critic, ref", [(False, False), (False, True), (True, False)])
def test_a_step_on_teacher_data_samples_nothing_and_trains_the_actor_only(critic, ref):
    """``--teacher-data``'s steps (GKD's mixture): the rows, pooled, the reference's log-probs when a KL term
    reads them, the actor's own (the rows' behaviour log-probs), the actor's update; no sampling, scoring,
    advantages or critic; the other steps are the method's own."""
    rl = Recorder(critic=critic, ref=ref, teacher_step=1)
    batch, metrics = rl_step(rl, 1)
    want = ["teacher_rows", "pool", *(["ref_logprobs"] if ref else []), "old_logprobs(teacher rows)", "update_actor"]
    assert rl.calls == want and batch == "rows"
    assert metrics["distill/teacher_data"] == 1.0 and "reward/mean" not in metrics
    other = Recorder(critic=critic, ref=ref, teacher_step=1)
    rl_step(other, 0)
    assert "sample" in other.calls and "teacher_rows" not in other.calls
