"""DAPO's dynamic sampling rule on hand-built scores: which groups vary, and which make the batch."""

from __future__ import annotations

import pytest
import torch

from rlctl.algos.filtering import next_round_size, pick_groups, varied_groups


def test_varied_groups_by_hand():
    scores = torch.tensor(
        [
            [1.0, 1.0, 1.0],  # all right: dropped
            [0.0, 0.0, 0.0],  # all wrong: dropped
            [0.0, 1.0, 0.0],  # kept
            [0.5, 0.5, 0.5000001],  # any difference is kept (verl: std > 0)
            [-0.25, -0.25, -0.25],  # equal after the overlong penalty too
        ]
    ).reshape(-1)
    assert varied_groups(scores, 3).tolist() == [False, False, True, True, False]
    assert varied_groups(torch.zeros(0), 4).tolist() == []
    with pytest.raises(ValueError, match="groups of 4"):
        varied_groups(torch.zeros(6), 4)


def test_pick_waits_for_a_full_batch_then_takes_the_earliest_varied_groups():
    # round 0: positions 0..3, only 1 and 3 vary; the target is 3 groups
    first = [(0, 0, False), (0, 1, True), (0, 2, False), (0, 3, True)]
    assert pick_groups(first, 3, final=False) is None  # 2 < 3: another round
    # round 1 (given in rank order, not sorted): 2 more vary; one is surplus
    second = [(1, 2, True), (1, 0, True), (1, 1, False), (1, 3, False)]
    pick = pick_groups(first + second, 3, final=False)
    assert pick.picked == [(0, 1), (0, 3), (1, 0)]
    assert (pick.kept, pick.padded, pick.dropped, pick.surplus) == (3, 0, 4, 1)
    assert pick.full


def test_the_last_round_tops_the_batch_up_with_dropped_groups():
    groups = [(0, 0, False), (0, 1, True), (0, 2, False), (1, 0, False), (1, 1, False), (1, 2, False)]
    pick = pick_groups(groups, 3, final=True)
    assert pick.picked == [(0, 1), (0, 0), (0, 2)]  # the varied group first, then the earliest others
    assert (pick.kept, pick.padded, pick.dropped, pick.surplus) == (1, 2, 5, 0)
    assert not pick.full
    # fewer groups than the target in all: the batch is what there is
    assert pick_groups([(0, 0, True)], 3, final=True).picked == [(0, 0)]


def test_bad_dapo_settings_are_one_line_errors():
    import re

    from rlctl.config import build_config
    from rlctl.config.algorithm import check_algorithm
    from rlctl.errors import UserError

    for layer, words in (
        (
            {"algo": {"overlong_buffer": 2000}},
            "algo.overlong_buffer=2000 must be in 0..rollout.max_response_len (512)",
        ),
        ({"algo": {"dynamic_sampling": True}, "rollout": {"n": 1}}, "set rollout.n >= 2"),
        ({"algo": {"dynamic_max_rounds": 0}}, "algo.dynamic_max_rounds=0 must be >= 1"),
    ):
        with pytest.raises(UserError, match=re.escape(words)):
            check_algorithm(build_config("grpo", [layer]))
    check_algorithm(build_config("grpo", [{"algo": {"overlong_buffer": 512, "dynamic_sampling": True}}]))


def test_the_dapo_preset_has_the_papers_settings():
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.config.algorithm import check_algorithm
    from rlctl.errors import UserError
    from rlctl.presets import method_layers
    from rlctl.recipes.rl.spec import AlgoSpec

    cfg = build_config("grpo", method_layers("grpo", "dapo"))
    check_algorithm(cfg)
    spec = AlgoSpec.from_config(cfg)
    p = spec.policy
    assert (p.loss.name, p.clip_low, p.clip_high, p.agg) == ("ppo", 0.2, 0.28, "token-mean")
    assert spec.adv == "grpo" and spec.kl_coef == 0 and spec.norm_by_std
    a, r = cfg.algo, cfg.rollout
    assert a.dynamic_sampling and a.dynamic_max_rounds == 10
    assert (a.overlong_buffer, a.overlong_factor, r.max_response_len) == (4096, 1.0, 20480)
    assert (cfg.train.batch_size, r.n, a.mini_batch_size) == (512, 16, 32)  # 16 updates per step
    # a shorter cap from the command line: the buffer no longer fits, and the message says what to set
    short = build_config("grpo", [*method_layers("grpo", "dapo"), dotted_to_nested({"rollout.max_response_len": 1024})])
    with pytest.raises(UserError, match=r"--overlong-buffer 204 \(DAPO: 4096 of 20480\) or 0"):
        check_algorithm(short)


def test_dynamic_sampling_and_remax_are_refused_with_a_split_rollout():
    from rlctl.config import build_config
    from rlctl.config.algorithm import check_algorithm
    from rlctl.errors import UserError

    for algo, words in (({"dynamic_sampling": True}, "algo.dynamic_sampling"), ({"adv": "remax"}, "--adv remax")):
        with pytest.raises(UserError, match=f"{words} does not run with rollout.procs=1 .*set rollout.procs=0"):
            check_algorithm(build_config("grpo", [{"algo": algo, "rollout": {"procs": 1}}]))


def test_a_later_round_draws_about_the_prompts_still_missing():
    # 9 varied groups missing, 23 of 32 seen varied: 1.25 * 9 * 32 / 23 = 15.65 -> 16 prompts
    assert next_round_size(9, 23, 32, 32) == 16
    assert next_round_size(1, 32, 32, 32) == 2  # ceil(1.25)
    assert next_round_size(30, 2, 32, 32) == 32  # never more than a whole batch
    assert next_round_size(5, 0, 32, 32) == 32  # nothing varied yet: a whole batch


def test_the_sampler_stream_continues_the_steps_batches_across_epochs():
    from rlctl.data.packing import StepSampler

    s = StepSampler(10, 4, seed=3)  # batches of 4, 4, 2 per epoch
    for step in range(7):
        assert s.stream(s.first(step), len(s.indices(step))) == s.indices(step)
    assert [s.first(k) for k in range(4)] == [0, 4, 8, 10]
    across = s.stream(8, 5)  # the last 2 of epoch 0, then the first 3 of epoch 1
    assert across == s.indices(2) + s.indices(3)[:3]
    assert sorted(s.stream(0, 10)) == list(range(10)) and s.stream(0, 10) != s.stream(10, 10)
