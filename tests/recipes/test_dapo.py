"""DAPO in the RL step: dynamic sampling (rlctl.recipes.rl.dynamic: each rank's groups, the batch the
picked groups make on every rank, the step's metrics from its rounds) and overlong filtering (the update
with truncated samples masked equals the update without them)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from rlctl.algos.filtering import pick_groups
from rlctl.recipes.rl.batch import RolloutBatch, mask_truncated, rank_positions
from rlctl.recipes.rl.dynamic import assemble, combine_rounds, local_groups
from tests.support.cli import run_cli
from tests.support.rl import REWARDS, arith_rows, eos_prone_model, failure, rl_args, train_records
from tests.support.sft import write_jsonl

N, PROMPTS, WIDTH = 2, 4, 3


def _round(r: int, rank: int, world: int, scores: list[float]) -> RolloutBatch:
    """Rank ``rank``'s samples of round ``r``: its share of 4 prompts x 2 samples, in generation order
    (samples of a prompt together, the prompts not sorted); sample (p, j) has the response [r, p, j]."""
    positions = rank_positions(PROMPTS, 0, rank, world)[::-1]
    uid = [p * N + j for p in positions for j in range(N)]
    b = RolloutBatch.build(
        [[7, p] for p in positions for _ in range(N)],
        [[10 + r, 20 + u // N, 30 + u % N] for u in uid],
        [[-0.1 * u] * WIDTH for u in uid],
        uid,
        n=N,
        batch_size=PROMPTS,
        mini_batch_size=0,
        width=WIDTH,
    )
    b.scores = torch.tensor([scores[u] for u in uid])
    return b


def test_two_ranks_agree_on_the_batch_and_each_keeps_its_own_picked_groups():
    # round 0: prompts 1 and 2 vary; round 1: prompts 0 and 3 vary. The target is 3 groups.
    scores = [[1, 1, 0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 1, 1, 0.5, 0]]
    world = 2
    rounds = {rank: [_round(r, rank, world, scores[r]) for r in range(2)] for rank in range(world)}
    seen = [(r, p, v) for rank in range(world) for r in range(2) for p, v in local_groups(rounds[rank][r])]
    assert sorted(seen) == [(0, 0, False), (0, 1, True), (0, 2, True), (0, 3, False)] + [
        (1, 0, True),
        (1, 1, False),
        (1, 2, False),
        (1, 3, True),
    ]
    pick = pick_groups(seen, 3, final=False)
    assert pick.picked == [(0, 1), (0, 2), (1, 0)]
    parts = [assemble(rounds[rank], pick, mini_batch_size=2) for rank in range(world)]
    # rank 0 generated positions 0 and 2 of each round, rank 1 positions 1 and 3
    assert sorted(parts[0].uid.tolist()) == [2, 3, 4, 5] and sorted(parts[1].uid.tolist()) == [0, 1]
    for b in parts:
        assert b.total == 3 * N and b.num_minis == 2 and b.n == N
        assert torch.equal(b.mini, b.uid // N // 2)
        for i, u in enumerate(b.uid.tolist()):
            r, p = pick.picked[u // N]
            assert b.responses[i] == [10 + r, 20 + p, 30 + u % N]  # the sample, carried with its fields
            assert b.prompts[i] == [7, p]
            assert float(b.scores[i]) == scores[r][p * N + u % N]
            assert torch.allclose(b.rollout_logp[i], torch.full((WIDTH,), -0.1 * (p * N + u % N)))


def test_a_rank_with_none_of_the_picked_groups_holds_an_empty_batch():
    scores = [0, 1, 1, 1, 0, 0, 1, 1]  # only prompt 0 varies, on rank 0
    rounds = {rank: [_round(0, rank, 2, scores)] for rank in range(2)}
    seen = [(0, p, v) for rank in range(2) for p, v in local_groups(rounds[rank][0])]
    pick = pick_groups(seen, 1, final=False)
    empty = assemble(rounds[1], pick, mini_batch_size=0)
    assert len(empty) == 0 and empty.mask.shape == (0, WIDTH) and empty.total == N and empty.num_minis == 1


def test_round_metrics_combine_into_the_steps():
    parts = [
        {
            "reward/mean": 0.5,
            "reward/std": 0.5,
            "acc": 0.5,
            "tokens": 100.0,
            "response_len/max": 9.0,
            "time/rollout": 2.0,
        },
        {"reward/mean": 0.0, "reward/std": 0.0, "tokens": 60.0, "response_len/max": 12.0, "time/rollout": 1.5},
        {"reward/mean": 1.0, "reward/std": 0.0, "tokens": 40.0, "response_len/max": 3.0, "warning": "w"},
    ]
    counts = [8.0, 8.0, 4.0]
    # response lengths: 8 of 4 and 8 (mean 6, std 2), 8 of 9 and 11 (mean 10, std 1), 4 of 2 (mean 2, std 0)
    lengths = [4.0, 8.0] * 4 + [9.0, 11.0] * 4 + [2.0] * 4
    for part, (m, sd) in zip(parts, [(6.0, 2.0), (10.0, 1.0), (2.0, 0.0)]):
        part.update({"response_len/mean": m, "response_len/std": sd})
    out = combine_rounds(parts, counts)
    assert math.isclose(out["response_len/mean"], statistics.fmean(lengths))
    assert math.isclose(out["response_len/std"], statistics.pstdev(lengths))
    # every sample: 8 of mean 0.5 (4 ones), 8 zeros, 4 ones -> 8 ones of 20
    scores = [1.0] * 4 + [0.0] * 4 + [0.0] * 8 + [1.0] * 4
    mean = sum(scores) / 20
    assert math.isclose(out["reward/mean"], mean)
    assert math.isclose(out["reward/std"], math.sqrt(sum((s - mean) ** 2 for s in scores) / 20))
    assert out["tokens"] == 200.0 and out["response_len/max"] == 12.0 and out["time/rollout"] == 3.5
    assert "acc" not in out  # not every round had binary scores
    assert out["warning"] == "w"


# ---------------------------------------------------------------------------------------------
# Overlong filtering


@pytest.mark.parametrize(
    ("role", "agg"), [("actor", "token-mean"), ("actor", "seq-mean-token-mean"), ("critic", "seq-mean-token-mean")]
)
def test_masked_truncated_samples_change_the_update_as_if_they_were_absent(tiny_model_dir, process_group, role, agg):
    """One optimizer step on 3 prompts x 2 samples with 2 truncated samples masked (their advantages and
    returns came from their groups) gives the weights of the same step on the 4 other samples alone: for
    the policy, and for the critic's value loss (PPO)."""
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.recipes.rl.spec import AlgoSpec
    from rlctl.recipes.rl.update import update_actor, update_critic
    from tests.support.sft import cpu_spec

    cfg = build_config(
        "grpo" if role == "actor" else "ppo",
        [
            dotted_to_nested(
                {
                    "model.name": str(tiny_model_dir),
                    "algo.loss_agg": agg,
                    "rollout.max_response_len": 6,
                    "train.lr": 1e-3,
                }
            )
        ],
    )
    algo = AlgoSpec.from_config(cfg)
    rng = random.Random(5)
    uid = list(range(6))
    responses = [[rng.randrange(4, 300) for _ in range(rng.randint(2, 6))] for _ in uid]
    batch = RolloutBatch.build(
        [[5, 6, 7 + u // 2] for u in uid], responses, [[0.0] * len(r) for r in responses], uid,
        n=2, batch_size=3, mini_batch_size=0, width=6, truncated=[False, True, False, False, True, False],
    )  # fmt: skip
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])[:, None] * batch.mask
    batch.values = torch.linspace(-0.3, 0.4, 36).reshape(6, 6) * batch.mask  # the critic before the update
    batch.returns = torch.tensor([2.0, -3.0, 0.5, 1.0, 4.0, -1.0])[:, None] * batch.mask
    kept = batch.take([0, 2, 3, 5])
    assert mask_truncated(batch) == 2
    assert batch.mask[[1, 4]].sum() == 0 and torch.equal(batch.mask[[0, 2, 3, 5]], kept.mask)
    spec = cpu_spec(cfg)  # lr 1e-3, the critic's too
    weights = []
    for b in (batch, kept):
        b.old_logp = None  # one optimizer step: the update's own forward gives the old log-probs
        engine = FSDPEngine(spec, role=role, total_steps=1)
        if role == "actor":
            update_actor(engine, b, algo, budget=64, pad_id=0)
        else:
            update_critic(engine, b, algo, budget=64, pad_id=0)
        weights.append({k: v.detach().clone() for k, v in engine.model.state_dict().items()})
    worst = max((weights[0][k].full_tensor() - weights[1][k].full_tensor()).abs().max() for k in weights[0])
    assert worst < 1e-6
    moved = FSDPEngine(spec, role=role, total_steps=1).model.state_dict()
    assert any((weights[0][k].full_tensor() - moved[k].full_tensor()).abs().max() > 1e-4 for k in moved)


# ---------------------------------------------------------------------------------------------
# End to end: 2 processes, dynamic sampling, resumed exactly

DYNAMIC_COMPARED = ("reward/mean", "dynamic/rounds", "dynamic/kept_groups", "pg/loss", "grad_norm")


@pytest.mark.slow
def test_dynamic_sampling_on_two_processes_fills_batches_and_resumes_exactly(tiny_model_dir, tmp_path):
    """Even-answer prompts always score 0 (every sample the same): dynamic sampling drops them and
    samples more prompts, every rank agreeing; 3 steps straight equal 1 step, a stop, and a resume."""
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(16))
    sets = ("--set", "algo.dynamic_sampling=true", "--set", "algo.dynamic_max_rounds=3")

    def grpo(run, *extra, env=None):
        args = rl_args(tiny_model_dir, data, run, "--rollout", "hf", "--max-steps", "3", *sets, *extra)
        args[args.index("--reward") + 1] = f"{REWARDS}:digits_when_odd"
        res = run_cli("grpo", *args, "--set", "checkpoint.export_hf=false", env=env)
        return res

    ref = tmp_path / "ref"
    res = grpo(ref)
    assert res.returncode == 0, failure(res, ref)
    want = train_records(ref)
    assert [r["step"] for r in want] == [1, 2, 3]
    for r in want:  # 4 prompts x 8 samples in the first round, at most as many in the others
        assert r["dynamic/kept_groups"] + r["dynamic/padded_groups"] == 4
        rounds, extra = r["dynamic/rounds"], r["dynamic/extra_samples"]
        assert r["dynamic/generated_samples"] == 32 + extra and 8 * (rounds - 1) <= extra <= 32 * (rounds - 1)
        groups = r["dynamic/generated_samples"] / 8
        assert groups == r["dynamic/kept_groups"] + r["dynamic/dropped_groups"] + r["dynamic/surplus_groups"]
        assert r["dynamic/dropped_groups"] >= 1 or rounds == 1
    assert sum(r["dynamic/dropped_groups"] for r in want) > 0 and max(r["dynamic/rounds"] for r in want) > 1
    run = tmp_path / "run"
    first = grpo(run, env={"RLCTL_STOP_AFTER_STEP": "1"})
    assert first.returncode == 130, failure(first, run)
    second = grpo(run, "--resume", "auto")
    assert second.returncode == 0, failure(second, run)
    got = train_records(run)
    for key in DYNAMIC_COMPARED:
        assert [r[key] for r in got] == [r[key] for r in want], key


@pytest.mark.slow
def test_ppo_with_a_critic_keeps_varied_groups_and_filters_truncated_samples(tiny_model_dir, tmp_path):
    """`rlctl ppo` (GAE, a critic) with dynamic sampling and overlong filtering, 2 processes, 2 steps, on a
    model that ends about half its responses: the dynamic/* counts add up; in samples.jsonl (all of rank
    0's samples of each step) every group of a full batch varies in reward, and a truncated sample has
    no advantage left (its loss mask is zeroed for the policy and the critic alike) while the others do."""
    import json

    model = eos_prone_model(tiny_model_dir, tmp_path / "model")
    # in stream order (no shuffling) odd answers at even positions: each round's odd positions, rank 1's,
    # always score 0 and are dropped, so rank 1 may hold none of a step's groups (no values, no update)
    rows = [{**r, "answer": str(2 * i if i % 2 else 2 * i + 1)} for i, r in enumerate(arith_rows(32))]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    run = tmp_path / "run"
    dapo = ("--dynamic-sampling", "--overlong-filter", "--critic-lr", "1e-3", "--samples-every", "1")
    args = rl_args(model, data, run, "--rollout", "hf", "--max-steps", "2", "--n", "4", "--kl-coef", "0", *dapo)
    args[args.index("--reward") + 1] = f"{REWARDS}:digits_when_odd"
    args[args.index("--lr") + 1] = "1e-3"  # the model keeps ending some responses after an update
    sets = ("algo.dynamic_max_rounds=3", "log.samples=64", "checkpoint.export_hf=false", "data.shuffle=false")
    res = run_cli("ppo", *args, *[x for s in sets for x in ("--set", s)])
    assert res.returncode == 0, failure(res, run)
    records = train_records(run)
    assert [r["step"] for r in records] == [1, 2]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    for r in records:
        assert r["dynamic/kept_groups"] + r["dynamic/padded_groups"] == 4
        groups = r["dynamic/generated_samples"] / 4
        assert groups == r["dynamic/kept_groups"] + r["dynamic/dropped_groups"] + r["dynamic/surplus_groups"]
        assert r["dynamic/generated_samples"] == 16 + r["dynamic/extra_samples"]
        mine = [s for s in samples if s["step"] == r["step"]]
        by_prompt: dict[str, list[dict]] = {}
        for s in mine:
            by_prompt.setdefault(s["prompt"], []).append(s)
        assert mine and all(len(g) == 4 for g in by_prompt.values())
        varied = sum(len({s["reward"] for s in g}) > 1 for g in by_prompt.values())
        assert varied >= len(by_prompt) - r["dynamic/padded_groups"]
        cut = [s for s in mine if s["truncated"]]
        assert all(s["advantage"] == 0.0 for s in cut) and len(cut) <= r["response/overlong_filtered"]
        assert all(s["advantage"] != 0.0 for s in mine if not s["truncated"])
    assert sum(r["dynamic/dropped_groups"] for r in records) > 0
    assert any(len({s["prompt"] for s in samples if s["step"] == r["step"]}) == 4 for r in records)  # rank 1: none
    ended = [s["truncated"] for s in samples]
    assert any(ended) and not all(ended), ended  # both kinds were trained on or filtered
