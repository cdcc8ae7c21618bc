"""The one GRPO / PPO step (rlctl.recipes.rl.main.rl_step): the passes each method ran in its own recipe
before they shared it, in the same order: GRPO without a critic, PPO with one, the actor left alone during
``algo.critic_warmup``. The trainer is a recorder (FAKE: the passes themselves are covered by the
pinned runs, tests/support/scripts/pinned_runs.py, and the recipe tests)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlctl.recipes.rl.main import METHODS, rl_step


class Recorder:  # FAKE: an RLTrainer that records which step ran
    def __init__(self, *, critic: bool, ref: bool, warmup: int = 0):
        self.calls: list[str] = []
        self.critic = object() if critic else None
        self.ref = object() if ref else None
        self.algo = SimpleNamespace(critic_warmup=warmup)

    def sample(self, step):
        self.calls.append("sample")
        return "batch", {"reward/mean": 1.0}

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
