"""The response-length metrics of a step (rlctl.recipes.rl.scoring.response_metrics), against statistics."""

from __future__ import annotations

import math
import statistics

import torch

from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.recipes.rl.scoring import response_metrics


def test_response_length_metrics_equal_the_samples_statistics():
    responses = [[5] * k for k in (1, 3, 3, 8, 20, 2)]
    prompts = [[7] * k for k in (4, 4, 2, 2, 6, 6)]
    width = max(len(r) for r in responses)
    batch = RolloutBatch.build(
        prompts,
        responses,
        [[0.0] * len(r) for r in responses],
        list(range(6)),
        n=2,
        batch_size=3,
        mini_batch_size=0,
        width=width,
        truncated=[False, False, False, False, True, False],
    )
    m = response_metrics(batch, torch.device("cpu"))  # one process: no collective
    lengths = [len(r) for r in responses]
    assert math.isclose(m["response_len/mean"], statistics.fmean(lengths))
    assert math.isclose(m["response_len/std"], statistics.pstdev(lengths))
    assert m["response_len/max"] == 20.0 and math.isclose(m["response/truncated"], 1 / 6)
    assert m["tokens"] == sum(lengths) + sum(len(p) for p in prompts)
