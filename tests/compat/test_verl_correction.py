"""Rollout correction thresholds as verl reads ``rollout_is_threshold``: a number (or a number as a string) is
TIS's upper bound; ``"L_U"`` is IcePop's masked IS, weights outside ``[L, U]`` zeroed. (A Python API case: the
run config types the threshold as numbers, ``algo.correction_threshold`` / ``correction_lower``.)"""

from __future__ import annotations

import math

import pytest
import torch

from rlctl.algos.correction import is_weights


def _weights(threshold, **kw) -> list[float]:
    ratios = [0.3, 0.8, 1.5, 3.0]
    log_ratio = torch.log(torch.tensor([ratios], dtype=torch.float64))
    w, _ = is_weights(log_ratio, torch.ones(1, 4), threshold=threshold, **kw)
    return w[0].tolist()


def test_an_l_u_threshold_masks_as_verl_reads_it():
    assert _weights("0.5_2.0") == pytest.approx([0.0, 0.8, 1.5, 0.0])  # inside [0.5, 2]: kept; outside: 0
    assert _weights(2.0) == pytest.approx([0.3, 0.8, 1.5, 2.0])  # U alone: truncated at U
    assert _weights("2.0") == pytest.approx([0.3, 0.8, 1.5, 2.0])  # verl's float-like string: the same
    assert _weights("0.5_2.0", mode="tis") == pytest.approx([0.3, 0.8, 1.5, 2.0])  # a mode given still wins
    assert not any(math.isnan(x) for x in _weights("0.25_4"))
