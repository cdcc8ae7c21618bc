"""ReMax (``--adv remax``): the recipe generates one greedy response per prompt because the estimator
declares it needs one, and its score is every sample's baseline."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

from rlctl.recipes.rl.batch import RolloutBatch
from tests.support.cli import run_cli
from tests.support.rl import arith_rows, failure, rl_args, train_records
from tests.support.sft import write_jsonl


def test_remax_is_registered_as_needing_a_greedy_rollout_and_takes_its_baseline_by_hand(process_group):
    from rlctl.algos import get_adv_estimator
    from rlctl.config import build_config
    from rlctl.recipes.rl.advantages import compute_advantages, token_rewards
    from rlctl.recipes.rl.spec import AlgoSpec

    e = get_adv_estimator("remax")
    assert e.needs_greedy and not e.needs_critic and not e.needs_groups
    assert not any(get_adv_estimator(n).needs_greedy for n in ("grpo", "rloo", "gae", "opo"))
    # 2 prompts x 2 samples, given out of uid order: the baselines follow their rows
    uid = [3, 0, 2, 1]
    responses = [[5, 6], [7], [8, 9, 10], [11, 12]]
    b = RolloutBatch.build(
        [[1, 2]] * 4, responses, [[0.0] * len(r) for r in responses], uid, n=2, batch_size=2, mini_batch_size=0, width=3
    )
    b.scores = torch.tensor([1.0, 0.0, 0.25, 1.0])
    b.baselines = torch.tensor([0.5, 0.25, 0.5, 0.25])  # prompt 0 (uid 0, 1): 0.25; prompt 1 (uid 2, 3): 0.5
    algo = AlgoSpec.from_config(build_config("grpo", [{"algo": {"adv": "remax"}}]))
    adv, returns = compute_advantages(b, algo, token_rewards(b))
    # A_t = (reward-to-go of the outcome score) - b, on every response token
    assert torch.allclose(
        adv, torch.tensor([[0.5, 0.5, 0.0], [-0.25, 0.0, 0.0], [-0.25, -0.25, -0.25], [0.75, 0.75, 0]])
    )
    assert torch.allclose(returns, b.scores[:, None] * b.mask)


@pytest.mark.slow
def test_remax_run_uses_the_greedy_score_as_each_prompts_baseline(tiny_model_dir, tmp_path):
    """2 steps of ``--adv remax`` with the soft overlong punishment on: every sample of a prompt has the same
    baseline (score - advantage in samples.jsonl), and its mean over the prompts is ``reward/greedy_baseline``."""
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(8))
    run = tmp_path / "run"
    args = rl_args(tiny_model_dir, data, run, "--rollout", "hf", "--max-steps", "2", "--adv", "remax")
    args[args.index("--n") + 1] = "2"
    args[args.index("--nproc") + 1] = "1"  # samples.jsonl holds rank 0's samples: here all of them
    extra = ("--samples-every", "1", "--set", "log.samples=8", "--set", "algo.overlong_buffer=4")
    res = run_cli("grpo", *args, *extra, "--set", "checkpoint.export_hf=false")
    assert res.returncode == 0, failure(res, run)
    records = train_records(run)
    assert [r["step"] for r in records] == [1, 2]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    for step, record in zip((1, 2), records):
        assert record["reward/overlong_penalty"] <= 0
        by_prompt = defaultdict(list)
        for s in samples:
            if s["step"] == step:
                by_prompt[s["prompt"]].append(s["reward"] - s["advantage"])
        assert len(by_prompt) == 4 and all(len(v) == 2 for v in by_prompt.values())
        for baselines in by_prompt.values():
            assert baselines[0] == pytest.approx(baselines[1], abs=1e-5)
        mean = sum(v[0] for v in by_prompt.values()) / 4
        assert record["reward/greedy_baseline"] == pytest.approx(mean, abs=1e-5)
