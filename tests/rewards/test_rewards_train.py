"""End-to-end GRPO runs (2 CPU processes, real torchrun) whose only reward is a class-based reward
manager or a reward model: the run trains unchanged and the reward rises with a fixed seed."""

from __future__ import annotations

import pytest

from tests.support.cli import run_cli
from tests.support.rl import arith_rows, failure, rl_args, train_records
from tests.support.sft import write_jsonl

RESPONSE_LEN = 8  # the tiny random policy rarely stops early: almost every response has 8 tokens

# A length-based reward manager as in verl's custom reward_manager articles, counted in characters of
# the decoded response (in tokens almost every response of the tiny policy has the same length): the longer,
# the higher. It logs the lengths it saw, so the test can recompute the scores from the metrics.
LENGTH_REWARD = """
import torch


class LengthReward:
    def __init__(self, tokenizer, scale: float = 50.0):
        self.tokenizer, self.scale = tokenizer, scale

    def __call__(self, batch):
        chars = torch.tensor([len(r) for r in batch.responses], dtype=torch.float32)
        tokens = [float(n) for n in batch.response_lengths]
        return {"reward_tensor": chars / self.scale, "reward_extra_info": {"chars": chars.tolist(), "tokens": tokens}}
"""


def _grpo(model_dir, tmp_path, *reward_args: str, steps: int = 6) -> list[dict]:
    data = write_jsonl(tmp_path / "data.jsonl", arith_rows(32))
    run = tmp_path / "run"
    args = rl_args(model_dir, data, run, "--rollout", "hf", "--max-steps", str(steps))
    args[args.index("--max-response-len") + 1] = str(RESPONSE_LEN)
    i = args.index("--reward")
    del args[i : i + 2]
    res = run_cli("grpo", *args, *reward_args, "--seed", "0", "--set", "checkpoint.export_hf=false")
    assert res.returncode == 0, failure(res, run)
    records = train_records(run)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert all(r["reward/errors"] == 0 for r in records)
    return records


def _rises(rewards: list[float], margin: float) -> None:
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + margin, " ".join(f"{x:.4f}" for x in rewards)


@pytest.mark.slow
def test_class_based_length_reward_trains(tiny_model_dir, tmp_path):
    reward = tmp_path / "length_reward.py"
    reward.write_text(LENGTH_REWARD)
    records = _grpo(tiny_model_dir, tmp_path, "--reward", f"{reward}:LengthReward")
    for r in records:
        # the class saw the logged response lengths, and its scores are its formula: chars / 50
        assert r["reward/tokens"] == pytest.approx(r["response_len/mean"], abs=1e-5)
        assert r["reward/mean"] == pytest.approx(r["reward/chars"] / 50.0, abs=1e-5)
    _rises([r["reward/mean"] for r in records], 0.05)  # ~2.5 more characters per response


def _tiny_reward_model(out):
    """A tiny ``Qwen2ForSequenceClassification`` (num_labels=1, the policy's tokenizer) whose score is
    learnable in a few steps: the mean over every token of ``prompt + response`` of a per-token feature,
    the token's length in characters (at most 8, / 8).

    From random weights: embedding dimension 0 holds the feature, dimension 1 is 0, the rest stay
    random, scaled so that every row's RMS is 1 (RMSNorm then leaves the rows unchanged). Layer 0's
    attention is uniform (q_proj 0, so every causal position averages its prefix) and copies dimension
    0 into dimension 1 (v_proj and o_proj one-hot); every other attention output and both MLPs are 0;
    the score head reads dimension 1, times 10. So the last token's hidden state carries the
    sequence's mean feature, which the head returns (x 10, divided by the final norm's RMS, ~1). A
    random head on random layers scores mostly the last token and does not rise in a few steps."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    from rlctl.testing import build_tokenizer, tiny_qwen2_config

    tok = build_tokenizer(out)
    config = tiny_qwen2_config(vocab_size=len(tok), num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        emb = rm.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        emb[:, 0] = torch.tensor([min(len(tok.decode([t])), 8) / 8 for t in range(len(tok))])
        emb[:, 1] = 0.0
        rest = (128.0 - emb[:, 0] ** 2).sqrt() / emb[:, 2:].norm(dim=1)
        emb[:, 2:] *= rest[:, None]  # every row's RMS is exactly 1: RMSNorm leaves the rows as they are
        for layer in rm.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        attn = rm.model.layers[0].self_attn
        attn.q_proj.weight.zero_()
        attn.q_proj.bias.zero_()
        attn.v_proj.weight.zero_()
        attn.v_proj.bias.zero_()
        attn.v_proj.weight[0, 0] = 1.0
        attn.o_proj.weight[1, 0] = 1.0
        rm.score.weight.zero_()
        rm.score.weight[0, 1] = 10.0
    rm.save_pretrained(str(out))
    return out


@pytest.mark.slow
def test_reward_model_alone_trains(tiny_model_dir, tmp_path):
    rm = _tiny_reward_model(tmp_path / "rm")
    records = _grpo(tiny_model_dir, tmp_path, "--reward-model", str(rm), steps=12)
    _rises([r["reward/mean"] for r in records], 0.1)
