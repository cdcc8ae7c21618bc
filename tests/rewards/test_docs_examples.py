"""The reward examples of docs/rewards.md run as written."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from rlctl.rewards import RewardBatch, RewardManager, reward_metrics
from tests.support.cli import REPO

BLOCK = re.compile(r"```python\n# (\w+\.py)[^\n]*\n(.*?)```", re.DOTALL)


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    out = tmp_path_factory.mktemp("doc_rewards")
    found = {}
    for name, body in BLOCK.findall((REPO / "docs" / "rewards.md").read_text()):
        (out / name).write_text(body)
        found[name] = out / name
    assert {"my_reward.py", "batch_reward.py", "length_reward.py"} <= set(found)
    return found


def score(fns, responses, truths, tokenizer=None):
    n = len(responses)
    batch = RewardBatch(
        [""] * n, responses, [[1]] * n, [[1] * k for k in range(1, n + 1)], ["m"] * n, truths, [None] * n
    )
    manager = RewardManager(SimpleNamespace(fn="auto", fns=fns, workers=0, timeout=10.0, model=""), tokenizer=tokenizer)
    result = manager.score(batch)
    return result.scores, reward_metrics(result.sums, result.errors)


def test_custom_function_example(examples):
    good = r"<think>x</think><answer>$\boxed{\frac12}$</answer>"
    scores, m = score([str(examples["my_reward.py"])], [good, r"\boxed{3}"], ["0.5", "0.5"])
    assert scores == pytest.approx([1.1, 0.0])  # correct + 0.1 * well formed
    assert m["reward/acc"] == 0.5 and m["reward/format"] == 0.5


def test_batch_example(examples):
    scores, _ = score([str(examples["batch_reward.py"])], ["so 42", "41"], ["42", "42"])
    assert scores == [1.0, 0.0]


def test_class_example_with_weights(examples):
    from rlctl.testing import build_tokenizer

    spec = f"{examples['length_reward.py']}:LengthReward:0.1"
    scores, m = score(["exact", spec], ["a", "b"], ["a", "a"], tokenizer=build_tokenizer())
    # response_ids have 1 and 2 tokens; max_len 512
    assert scores == pytest.approx([1 + 0.1 * (1 - 1 / 512), 0.1 * (1 - 2 / 512)])
    assert m["reward/exact"] == 0.5
