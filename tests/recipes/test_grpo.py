"""GRPO: prompt data, rank shares, packed log-probs, advantages, the update's world-size independence,
and end-to-end CLI runs on 2 CPU processes with the hf and vllm rollout engines."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.cli import REPO, run_cli, torchrun
from tests.support.rl import (
    REWARDS,
    UPDATE_STEP,
    arith_rows,
    error_line,
    failure,
    rl_args,
    train_records,
    verl_rows,
)
from tests.support.sft import cpu_spec, write_jsonl

LOGPROB_TOL = 1e-3  # fp32 on CPU: the engines agree with the trainer to ~1e-6


def rl_config(model_dir, data="", **sets):
    from rlctl.config import build_config, dotted_to_nested

    base = {
        "model.name": str(model_dir),
        "data.path": str(data),
        "rollout.max_prompt_len": 48,
        "rollout.max_response_len": 12,
        "model.attn": "sdpa",
        "model.dtype": "fp32",
    }
    base.update({k.replace("__", "."): v for k, v in sets.items()})
    return build_config("grpo", [dotted_to_nested(base)])


# ---------------------------------------------------------------------------------------------
# Data


def test_plain_and_verl_rows_render_through_the_chat_template(tiny_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from rlctl.data.rl import build_rl_data

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    plain = write_jsonl(
        tmp_path / "plain.jsonl",
        arith_rows(5) + [{"prompt": "What is " + "1 + " * 60 + "1?", "answer": "61"}, {"answer": "3"}],
    )
    data = build_rl_data(rl_config(tiny_model_dir, plain, data__max_bad_fraction=0.5), tok)
    assert len(data.train) == 5 and data.too_long == 1
    assert data.report.bad["missing field 'prompt'"] == 1
    text = tok.decode(data.train[0].token_ids)
    assert text == f"<|im_start|>user\n{arith_rows(1)[0]['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    assert data.train[0].ground_truth == arith_rows(1)[0]["answer"] and data.train[0].data_source == ""

    path = tmp_path / "verl.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows(4)), path)
    verl = build_rl_data(rl_config(tiny_model_dir, path), tok)
    first = verl.train[0]
    assert first.data_source == "openai/gsm8k" and first.ground_truth == verl_rows(1)[0]["reward_model"]["ground_truth"]
    assert first.extra_info == {"split": "train", "index": 0}
    assert tok.decode(first.token_ids).endswith("<|im_start|>assistant\n")


def test_missing_answer_field_names_the_field_and_the_fix(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from rlctl.data.rl import build_rl_data
    from rlctl.errors import UserError

    path = write_jsonl(tmp_path / "q.jsonl", arith_rows(4, answer_field="solution"))
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    with pytest.raises(UserError, match=r"'answer'.*--set data.answer_field=FIELD") as e:
        build_rl_data(rl_config(tiny_model_dir, path), tok)
    assert "solution" in str(e.value) and "\n" not in str(e.value)
    assert len(build_rl_data(rl_config(tiny_model_dir, path, data__answer_field="solution"), tok).train) == 4


# ---------------------------------------------------------------------------------------------
# Rank shares, packing, advantages


@pytest.mark.parametrize("batch,mini,world", [(8, 4, 2), (6, 4, 4), (5, 0, 2), (3, 2, 4)])
def test_rank_positions_deal_every_mini_batch_over_the_ranks(batch, mini, world):
    from rlctl.recipes.rl.batch import rank_positions

    shares = [rank_positions(batch, mini, r, world) for r in range(world)]
    assert sorted(p for s in shares for p in s) == list(range(batch))
    m = mini or batch
    for start in range(0, batch, m):
        counts = [sum(start <= p < start + m for p in s) for s in shares]
        assert max(counts) - min(counts) <= 1  # each mini-batch is split evenly


def _random_batch(n_prompts: int, n: int, vocab: int, *, width: int, seed: int = 0):
    from rlctl.recipes.rl.batch import RolloutBatch

    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(3, 14))] for _ in range(n_prompts)]
    uid = list(range(n_prompts * n))
    responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, width))] for _ in uid]
    return RolloutBatch.build(
        [prompts[u // n] for u in uid],
        responses,
        [[0.0] * len(r) for r in responses],
        uid,
        n=n,
        batch_size=n_prompts,
        mini_batch_size=0,
        width=width,
    )


def test_samples_are_pooled_by_model_replica():
    """A fake Megatron layout on 4 ranks, tp 2 x dp 2: every rank generates its own prompts' samples
    (rank_positions by global rank); the two TP ranks of a replica join theirs (RolloutBatch.join, in rank
    order), so both train on the same batch, and the two replicas split every mini-batch evenly, each
    sample once, its tensors carried along."""
    from rlctl.engines.megatron.parallel import rank_coords
    from rlctl.recipes.rl.batch import RolloutBatch, rank_positions

    n, n_prompts, mini, width = 2, 8, 4, 5
    full = _random_batch(n_prompts, n, 50, width=width, seed=3)
    full.scores = torch.arange(len(full), dtype=torch.float32)

    def generated_by(rank: int) -> RolloutBatch:
        rows = [u for p in rank_positions(n_prompts, mini, rank, 4) for u in range(p * n, p * n + n)]
        b = RolloutBatch.build(
            [full.prompts[u] for u in rows],
            [full.responses[u] for u in rows],
            [full.rollout_logp[u, : len(full.responses[u])].tolist() for u in rows],
            rows,
            n=n,
            batch_size=n_prompts,
            mini_batch_size=mini,
            width=width,
        )
        b.scores = full.scores[rows]
        return b

    replicas: dict[int, list[int]] = {}
    for rank in range(4):
        replicas.setdefault(rank_coords(rank, 4, tp=2, pp=1)["dp"], []).append(rank)
    assert replicas == {0: [0, 1], 1: [2, 3]}
    pooled = {dp: RolloutBatch.join([generated_by(r) for r in ranks]) for dp, ranks in replicas.items()}
    uids = [pooled[dp].uid.tolist() for dp in (0, 1)]
    assert sorted(uids[0] + uids[1]) == list(range(n_prompts * n))
    for dp in (0, 1):
        b = pooled[dp]
        assert b.total == n_prompts * n and b.num_minis == 2 and b.n == n
        assert len(b) == len(b.prompts) == len(b.truncated) == n_prompts * n // 2
        assert torch.equal(b.mini, b.uid // n // mini)
        for k in range(2):  # each mini-batch: half its prompts on each replica
            assert int((b.mini == k).sum()) == mini * n // 2
        for i, u in enumerate(b.uid.tolist()):
            assert b.responses[i] == full.responses[u] and b.prompts[i] == full.prompts[u]
            assert torch.equal(b.mask[i], full.mask[u]) and torch.equal(b.rollout_logp[i], full.rollout_logp[u])
            assert float(b.scores[i]) == float(full.scores[u])


def test_packed_log_probs_and_values_match_one_sequence_at_a_time(tiny_model_dir, process_group):
    """Packing several samples per row (positions restarting) gives each sample's own log-probs."""
    from transformers import AutoModelForCausalLM

    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.recipes.rl.passes import compute_logprobs, compute_values

    cfg = rl_config(tiny_model_dir)
    batch = _random_batch(3, 2, 400, width=12)
    ref = FSDPEngine(cpu_spec(cfg), role="ref", trainable=False)
    logp, ent = compute_logprobs(ref, batch, temperature=0.7, budget=40, pad_id=0, with_entropy=True)
    plain = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    critic = FSDPEngine(cpu_spec(cfg), role="critic", total_steps=1)
    values = compute_values(critic, batch, budget=40, pad_id=0)
    for i in range(len(batch)):
        p, r = batch.prompts[i], batch.responses[i]
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = plain(input_ids=ids).logits[0, len(p) - 1 : len(p) + len(r) - 1] / 0.7
            v = critic.forward(ids, torch.arange(ids.shape[1])[None])[0, len(p) - 1 : len(p) + len(r) - 1]
        want = logits.log_softmax(-1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        probs = logits.softmax(-1)
        want_ent = -(probs * probs.log()).sum(-1)
        assert torch.allclose(logp[i, : len(r)], want, atol=1e-5)
        assert torch.allclose(ent[i, : len(r)], want_ent, atol=1e-4)
        assert torch.allclose(values[i, : len(r)], v, atol=1e-5)
        assert logp[i, len(r) :].abs().sum() == 0 and values[i, len(r) :].abs().sum() == 0


def test_advantages_and_token_rewards_by_hand(process_group):
    from rlctl.recipes.rl.advantages import compute_advantages, token_rewards
    from rlctl.recipes.rl.spec import AlgoSpec

    batch = _random_batch(2, 3, 50, width=5)
    batch.scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    lengths = batch.mask.sum(-1).long()
    kl = torch.full_like(batch.mask, 0.5) * batch.mask
    r = token_rewards(batch, 0.2, kl)
    for i in range(6):
        want = [-0.1] * int(lengths[i])
        want[-1] += float(batch.scores[i])
        assert torch.allclose(r[i, : lengths[i]], torch.tensor(want)) and r[i, lengths[i] :].abs().sum() == 0

    r0 = token_rewards(batch)
    adv, _ = compute_advantages(batch, AlgoSpec.from_config(rl_config("m", algo__adv="grpo")), r0)
    # group 0: scores 1, 0, 0: mean 1/3, unbiased std sqrt(1/3); group 1: all equal -> 0
    std = (1 / 3) ** 0.5
    seq = [(1 - 1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), 0.0, 0.0, 0.0]
    assert torch.allclose(adv, torch.tensor(seq)[:, None] * batch.mask, atol=1e-5)
    adv, _ = compute_advantages(batch, AlgoSpec.from_config(rl_config("m", algo__adv="rloo")), r0)
    seq = [1 - 0.0, 0 - 0.5, 0 - 0.5, 0.0, 0.0, 0.0]  # s minus the mean of the others
    assert torch.allclose(adv, torch.tensor(seq)[:, None] * batch.mask, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# The update does not depend on the number of processes


def _run_update(world: int, batch_json: Path, out: Path, model_dir: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = torchrun(world, UPDATE_STEP, model_dir, batch_json, out)
    res = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return torch.load(out)


def _plain_update(model_dir: Path, spec: dict, agg: str) -> tuple[dict, dict, float]:
    """The same step written out plainly on one unsharded HF model: per-sample forwards, GRPO
    advantages from the group mean and unbiased std, loss over the whole batch, clip, AdamW."""
    from transformers import AutoModelForCausalLM

    s = spec["settings"]
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    n, t = spec["n"], s["rollout.temperature"]
    scores = torch.tensor(spec["scores"]).view(-1, n)
    adv = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).reshape(-1)
    per_seq, tokens = [], 0
    for u, resp in enumerate(spec["responses"]):
        prompt = spec["prompts"][u // n]
        logits = model(input_ids=torch.tensor([prompt + resp])).logits[0, len(prompt) - 1 : len(prompt) + len(resp) - 1]
        logp = (logits / t).log_softmax(-1).gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())  # old = current: one optimizer step on fresh samples
        per_seq.append(-adv[u] * ratio)
        tokens += len(resp)
    if agg == "token-mean":
        loss = sum(x.sum() for x in per_seq) / tokens
    else:  # seq-mean-token-mean
        loss = sum(x.mean() for x in per_seq) / len(per_seq)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    params = list(model.parameters())
    norm = float(torch.nn.utils.clip_grad_norm_(params, s["train.grad_clip"]))
    torch.optim.AdamW(params, lr=s["train.lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
    return {name: p.detach() for name, p in model.named_parameters()}, grads, norm


@pytest.mark.slow
def test_update_is_the_same_on_one_and_two_processes_and_matches_plain_torch(tiny_model_dir, tmp_path):
    rng = random.Random(1)
    n, n_prompts = 4, 4
    prompts = [[rng.randrange(4, 400) for _ in range(rng.randint(4, 16))] for _ in range(n_prompts)]
    responses = [[rng.randrange(4, 400) for _ in range(rng.randint(1, 8))] for _ in range(n_prompts * n)]
    scores = [float(rng.random() < 0.5) for _ in responses]
    scores[:n] = [1.0, 1.0, 1.0, 1.0]  # one group without signal
    settings = {
        "train.lr": 1e-3,
        "train.warmup_ratio": 0.0,
        "train.min_lr_ratio": 1.0,
        "train.grad_clip": 1.0,
        "train.max_tokens_per_micro_batch": 30,
        "rollout.n": n,
        "rollout.temperature": 0.7,
        "rollout.max_prompt_len": 16,
        "rollout.max_response_len": 8,
        "algo.kl_coef": 0.05,
        "algo.mini_batch_size": 0,
        "model.attn": "sdpa",
        "model.dtype": "fp32",
    }
    spec = {
        "n": n,
        "prompts": prompts,
        "responses": responses,
        "scores": scores,
        "settings": settings,
        "aggs": ["token-mean", "seq-mean-token-mean"],
    }
    batch_json = tmp_path / "batch.json"
    batch_json.write_text(json.dumps(spec))
    one = _run_update(1, batch_json, tmp_path / "one.pt", tiny_model_dir)
    two = _run_update(2, batch_json, tmp_path / "two.pt", tiny_model_dir)
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).state_dict()
    for agg in spec["aggs"]:
        want, want_grads, want_norm = _plain_update(tiny_model_dir, spec, agg)
        assert one[agg]["grad_norm"] == pytest.approx(want_norm, rel=1e-5)
        assert two[agg]["grad_norm"] == pytest.approx(want_norm, rel=1e-5)
        for name, g in want_grads.items():
            for got, world in ((one, 1), (two, 2)):
                err = (got[agg]["grads"][name] - g).abs().max()
                assert err <= 1e-5 * g.abs().max(), f"{agg}: grad {name} with {world} processes is off by {err}"
            # AdamW's first step is lr * g / (|g| + 1e-8): float noise (~1e-8 here) in a gradient near 0
            # moves its parameter visibly, so parameters are compared where the gradient is clearly not 0
            clear = g.abs() > 1e-5
            a, b = one[agg]["params"][name], two[agg]["params"][name]
            assert torch.allclose(a[clear], b[clear], atol=1e-7), f"{agg}: {name} differs between 1 and 2 processes"
            assert torch.allclose(a[clear], want[name][clear], atol=1e-7), (
                f"{agg}: {name} differs from the plain update"
            )
            assert clear.any() and not torch.equal(a, init[name]), name


# ---------------------------------------------------------------------------------------------
# End to end through the CLI (2 processes, gloo)


def _check_learning(records: list[dict], synced: list[int]) -> None:
    """The reward rises; the rollout engine matches the trainer after every weight sync."""
    rewards = [r["reward/mean"] for r in records]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.08, rewards
    diffs = [r["rollout/logprob_diff"] for r in records]
    assert max(diffs) < LOGPROB_TOL, diffs
    assert [r["step"] for r in records if r["time/weight_sync"] > 0] == synced


@pytest.mark.slow
def test_grpo_hf_rollout_learns_an_easy_reward(tiny_model_dir, tmp_path):
    """8 steps of 4 prompts x 8 samples: the digits reward rises; one prompt's grader fails (counted,
    the run goes on); every metric is logged; validation runs; checkpoint and HF export are written."""
    from rlctl.metrics import read_metrics

    rows = arith_rows(31) + [{"prompt": "What is 1 + 1?", "answer": "boom"}]
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    val = write_jsonl(tmp_path / "val.jsonl", arith_rows(4, seed=9))
    run = tmp_path / "run"
    res = run_cli(
        "grpo",
        *rl_args(
            tiny_model_dir,
            data,
            run,
            "--rollout",
            "hf",
            "--max-steps",
            "8",
            "--kl-coef",
            "0.001",
            "--set",
            "algo.entropy_coef=0.001",
            "--set",
            f"data.val_path={val}",
            "--set",
            "train.eval_every=4",
        ),
    )
    assert res.returncode == 0, failure(res, run)
    records = train_records(run)
    assert [r["step"] for r in records] == list(range(1, 9))
    _check_learning(records, synced=[2, 3, 4, 6, 7, 8])  # step 5 uses the weights synced for the eval at 4
    keys = {
        "reward/mean",
        "reward/std",
        "time/step",
        "response_len/mean",
        "kl",
        "entropy",
        "pg/clip_frac",
        "grad_norm",
        "rollout/logprob_diff",
        "time/rollout",
        "time/logprobs",
        "time/update",
        "time/weight_sync",
        "tokens_per_s",
        "reward/errors",
        "kl_loss",
    }
    assert keys <= set(records[-1]), keys - set(records[-1])
    assert sum(r["reward/errors"] for r in records) == 8  # the "boom" prompt once (8 steps = 1 epoch), n = 8
    assert "the reward function failed on 8 of 32 samples" in (run / "train.log").read_text()
    evals = [r for r in read_metrics(run / "metrics.jsonl") if r.get("kind") == "eval"]
    assert [r["step"] for r in evals] == [4, 8] and all(0 <= r["val/reward/mean"] <= 1 for r in evals)
    assert (run / "checkpoints" / "step_000008" / "trainer_state.json").is_file()
    assert (run / "hf" / "config.json").is_file()
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_grpo_vllm_rollout_learns_an_easy_reward(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(32))
    run = tmp_path / "run"
    res = run_cli(
        "grpo",
        *rl_args(
            tiny_model_dir, data, run, "--rollout", "vllm", "--max-steps", "7", "--set", "checkpoint.export_hf=false"
        ),
    )
    assert res.returncode == 0, failure(res, run)
    records = train_records(run)
    assert len(records) == 7
    _check_learning(records, synced=list(range(2, 8)))


@pytest.mark.slow
def test_reward_failing_on_every_sample_stops_the_run(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(8))
    args = rl_args(tiny_model_dir, data, tmp_path / "run", "--max-steps", "2")
    args[args.index("--reward") + 1] = f"{REWARDS}:always_fails"
    res = run_cli("grpo", *args)
    assert res.returncode == 2, res.stderr[-3000:]
    line = error_line(res)
    assert line.startswith("error: reward function") and "failed on every sample" in line
    assert "RuntimeError: the grading service is down (second line of the message)" in line
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_bad_data_and_unknown_reward_are_one_line_errors(tiny_model_dir, tmp_path):
    no_answer = write_jsonl(tmp_path / "q.jsonl", arith_rows(8, answer_field="solution"))
    res = run_cli("grpo", *rl_args(tiny_model_dir, no_answer, tmp_path / "a", "--nproc", "1"))
    assert res.returncode == 2, res.stderr[-3000:]
    assert "--set data.answer_field=FIELD" in error_line(res) and "Traceback" not in res.stderr

    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(8))
    args = rl_args(tiny_model_dir, data, tmp_path / "b", "--nproc", "1")
    args[args.index("--reward") + 1] = "gsm8kk"
    res = run_cli("grpo", *args)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "unknown reward 'gsm8kk' (did you mean gsm8k" in error_line(res) and "Traceback" not in res.stderr
