"""The hf engine's sampler: the log-prob convention of rlctl.rollout.base, and the inverse-CDF draw."""

from __future__ import annotations

import pytest
import torch

from rlctl.errors import UserError
from rlctl.rollout.base import SamplingParams
from rlctl.rollout.hf import draw, filter_top_k_top_p, sample_next_token


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.7, 5, 1.0), (1.3, -1, 0.6), (0.9, 3, 0.8)]
)
def test_logprob_convention_by_hand(temperature, top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 3
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=4)
    tokens, logprobs = sample_next_token(logits, sampling, torch.Generator().manual_seed(0))
    for row, (token, logprob) in enumerate(zip(tokens.tolist(), logprobs.tolist(), strict=True)):
        z = [x / temperature for x in logits[row].double().tolist()]
        expected = z[token] - torch.tensor(z, dtype=torch.float64).logsumexp(0).item()
        assert logprob == pytest.approx(expected, abs=1e-5)  # before top-k/top-p
        kept = filter_top_k_top_p(logits[row : row + 1] / temperature, top_k, top_p)[0]
        assert kept[token] > float("-inf")  # drawn from within the filters


def test_greedy_logprob_is_log_softmax_of_raw_logits():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    tokens, logprobs = sample_next_token(logits, SamplingParams(temperature=0, max_tokens=1), torch.Generator())
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = logits.double().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), expected, atol=1e-6, rtol=0)


def test_draw_follows_the_distribution_and_skips_zeros():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]]).expand(20000, 6)
    tokens = draw(probs, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6).double() / len(tokens)
    assert counts[[0, 2, 5]].sum().item() == 0
    torch.testing.assert_close(counts, probs[0].double(), atol=0.015, rtol=0)
    # a last token of probability 0 is never drawn, even with rows that sum to slightly less than 1
    edge = torch.tensor([[0.3333333, 0.6666666, 0.0]]).expand(5000, 3)
    assert draw(edge, torch.Generator().manual_seed(1)).max().item() <= 1


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_non_finite_logits_stop_with_one_line_error(temperature):
    logits = torch.zeros(3, 8)
    logits[1, 2] = float("nan")
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(UserError, match="logits are not finite"):
        sample_next_token(logits, SamplingParams(temperature=temperature), gen)
