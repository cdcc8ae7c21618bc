"""Reward functions for the RL and reward tests (verl's signatures)."""

import math
import os
import time


def digits(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's characters that are digits: a tiny random model can learn it in a
    few steps. The row whose answer is "boom" always fails (to test per-sample errors)."""
    if str(ground_truth) == "boom":
        raise ValueError("boom: this row's grader fails")
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))


def digits_when_odd(data_source, solution_str, ground_truth, extra_info=None):
    """:func:`digits` where the answer is odd, 0 where it is even: the samples of an even-answer prompt
    always score the same (DAPO's dynamic sampling drops them)."""
    return digits(data_source, solution_str, ground_truth) if int(ground_truth) % 2 else 0.0


def always_fails(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("the grading service is down\n(second line of the message)")


def flaky(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the response equals the truth; raises for "raise", nan for "nan", hangs for "hang",
    exits the process for "exit"."""
    if ground_truth == "raise":
        raise ValueError("cannot grade this one")
    if ground_truth == "nan":
        return math.nan
    if ground_truth == "hang":
        time.sleep(60)
    if ground_truth == "exit":
        os._exit(3)  # the process dies (a crash in a C extension)
    print("a reward function that prints")  # must not break the worker protocol
    return float(solution_str == ground_truth)


def batch_match(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    """verl's batch form: 1.0 per exact match, 0.5 when the truth is contained, else 0.0."""
    return [1.0 if s == g else 0.5 if g in s else 0.0 for s, g in zip(solution_strs, ground_truths)]


class LengthReward:
    """A class-based reward manager (like verl's custom reward_manager articles): the shorter the
    response in tokens, the higher, 1 - len / max_len; constructed once with the tokenizer."""

    def __init__(self, tokenizer, max_len: int = 10):
        self.tokenizer, self.max_len = tokenizer, max_len
        self.calls = 0

    def __call__(self, batch):
        import torch

        self.calls += 1
        lengths = torch.tensor(batch.response_lengths, dtype=torch.float32)
        return 1.0 - lengths.clamp(max=self.max_len) / self.max_len


def hangs(data_source, solution_str, ground_truth, extra_info=None):
    """Never returns (a grader stuck on a lock or a network call); touches $RLCTL_TEST_MARK first."""
    mark = os.environ.get("RLCTL_TEST_MARK")
    if mark:
        open(mark, "a").close()
    time.sleep(600)
