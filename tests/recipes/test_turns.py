"""Single-turn samples as one-turn trajectories (rlctl.recipes.rl.turns): the batch built from them is the
batch built from the engine's samples directly, and the single-turn mode tells the reward and the logs
nothing of turns, as a run without tools did before trajectories were its one path."""

from __future__ import annotations

import random

import torch

from rlctl.data.rl import Prompt
from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.recipes.rl.turns import MultiTurn, SingleTurn, make_turns, one_turn
from rlctl.rollout.base import Sample


def _samples(prompts: list[Prompt], n: int, rng: random.Random) -> list[Sample]:
    out = []
    for i in range(len(prompts)):
        for _ in range(n):
            k = rng.randint(1, 6)
            reason = "length" if k == 6 else "stop"
            out.append(Sample(i, [rng.randint(4, 90) for _ in range(k)], [-rng.random() for _ in range(k)], reason))
    return out


def test_a_batch_of_one_turn_trajectories_equals_the_batch_of_the_samples():
    rng = random.Random(3)
    prompts = [Prompt([1, 2 + i, 3], "t", str(i), None) for i in range(3)]
    samples = _samples(prompts, 4, rng)
    trajs = SingleTurn().trajectories(samples, prompts)
    common = dict(n=4, batch_size=3, mini_batch_size=3, width=6, meta=[prompts[s.prompt_index] for s in samples])
    uid = list(range(len(samples)))
    direct = RolloutBatch.build(  # the single-turn path before trajectories: no loss masks, no trajectories
        [prompts[s.prompt_index].token_ids for s in samples], [s.token_ids for s in samples],
        [s.logprobs for s in samples], uid, truncated=[s.finish_reason == "length" for s in samples], **common,
    )  # fmt: skip
    via = RolloutBatch.build(
        [t.prompt_ids for t in trajs], [t.token_ids for t in trajs], [t.logprobs for t in trajs], uid,
        truncated=[t.truncated for t in trajs], loss_masks=[t.mask for t in trajs], trajectories=trajs, **common,
    )  # fmt: skip
    assert via.prompts == direct.prompts and via.responses == direct.responses
    for name in ("mask", "rollout_logp", "truncated", "uid", "mini"):
        assert torch.equal(getattr(via, name), getattr(direct, name)), name
    assert via.truncated.any() and not via.truncated.all()  # both finish reasons are in the batch
    assert [t.turns for t in trajs] == [1] * len(samples) and all(t.mask == [1] * len(t.token_ids) for t in trajs)


def test_the_single_turn_mode_tells_nothing_of_turns_and_is_chosen_without_an_agent():
    prompts = [Prompt([1, 2], "t", "0", None)]
    t = one_turn(Sample(0, [5, 6], [-0.5, -0.25], "stop"), prompts[0])
    mode = make_turns(cfg=None, agent_spec=None, tokenizer=None, engine=None, rollout_tp=2)
    assert isinstance(mode, SingleTurn)
    assert mode.for_reward([t]) is None and mode.logged(t) == {} and mode.metrics([t], torch.device("cpu")) == {}
    multi = MultiTurn(loop=None, cfg=None)
    assert multi.for_reward([t]) == [t] and multi.logged(t)["turns"] == 1
