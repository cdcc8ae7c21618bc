"""RewardManager: routing, weighted components, failures, timeouts, batch / class rewards, reward model."""

from __future__ import annotations

import math
import time

import pytest

from rlctl.data.rl import Prompt
from rlctl.errors import UserError
from rlctl.rewards import RewardBatch, RewardManager, parse_spec, reward_metrics, reward_specs, reward_warning
from tests.support.rl import REWARDS


def cfg(**kw):
    """The run's ``reward`` config section (serial scoring unless a test asks for workers)."""
    from rlctl.config import RewardConfig

    return RewardConfig(**{"workers": 0, **kw})


def text_batch(responses, truths, sources=None, prompts=None):
    n = len(responses)
    return RewardBatch(
        prompts=prompts or [""] * n,
        responses=list(responses),
        prompt_ids=[[1]] * n,
        response_ids=[[1] * len(r) for r in responses],
        data_sources=sources or ["src"] * n,
        ground_truths=list(truths),
        extra_infos=[None] * n,
    )


def run(manager, batch):
    """Score and turn the (single-rank) sums into metrics, as the recipe does."""
    result = manager.score(batch)
    return result, reward_metrics(result.sums, result.errors)


# ---------------------------------------------------------------------------- specs


@pytest.mark.parametrize(
    "text,spec,weight,name",
    [
        ("gsm8k", "gsm8k", 1.0, "gsm8k"),
        ("format:0.2", "format", 0.2, "format"),
        ("my/reward.py:score:0.5", "my/reward.py:score", 0.5, "score"),
        ("pkg.mod:fn", "pkg.mod:fn", 1.0, "fn"),
        ("my/reward.py", "my/reward.py", 1.0, "reward"),
        ("length:-1", "length", -1.0, "length"),
    ],
)
def test_parse_spec(text, spec, weight, name):
    s = parse_spec(text)
    assert (s.spec, s.weight, s.name) == (spec, weight, name)


def test_reward_specs_unique_names_and_one_source():
    assert [s.name for s in reward_specs("auto", ["format", "format:0.5"])] == ["format", "format_2"]
    assert [(s.spec, s.weight) for s in reward_specs("gsm8k")] == [("gsm8k", 1.0)]
    with pytest.raises(UserError, match="list every reward in reward.fns") as e:
        reward_specs("gsm8k", ["format"])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="names no function"):
        parse_spec(":0.5")


# ---------------------------------------------------------------------------- routing


def test_auto_routes_by_data_source_and_a_named_function_scores_everything():
    gsm, plain = Prompt([1], "openai/gsm8k", "72", None), Prompt([1], "", "boom", None)
    auto = RewardManager(cfg(), ["openai/gsm8k", "lighteval/MATH"])
    result, m = run(
        auto,
        text_batch(
            ["so #### 72", "#### 71", r"\boxed{\frac12}"],
            ["72", "72", "0.5"],
            ["openai/gsm8k"] * 2 + ["lighteval/MATH"],
        ),
    )
    assert result.scores == [1.0, 0.0, 1.0] and m["reward/errors"] == 0 and m["acc"] == pytest.approx(2 / 3)
    with pytest.raises(UserError, match="rows without a data_source: pass --reward"):
        RewardManager(cfg(), [plain.data_source])
    named = RewardManager(cfg(fn=f"{REWARDS}:digits"), ["", "openai/gsm8k"])
    batch = text_batch(["12ab", "12ab", "1234"], [gsm.ground_truth, plain.ground_truth, gsm.ground_truth])
    result, m = run(named, batch)
    assert result.scores == [0.5, 0.0, 1.0]
    assert m["reward/failed"] == 1 and "ValueError: boom" in result.errors["digits"]
    assert "acc" not in m  # 0.5 is not a 0/1 score


def test_batch_from_token_ids_decodes_with_the_tokenizer():
    from rlctl.testing import build_tokenizer

    tok = build_tokenizer()
    manager = RewardManager(cfg(fn="exact"), tokenizer=tok)
    ids = tok("What is 1 + 2?")["input_ids"]
    resp = tok("3")["input_ids"] + [tok.eos_token_id]
    batch = manager.batch([ids], [resp], [Prompt(ids, "x", "3", {"k": 1})])
    assert batch.prompts == ["What is 1 + 2?"] and batch.responses == ["3"]
    assert batch.response_lengths == [len(resp)] and batch.extra_infos == [{"k": 1}]
    assert manager.score(batch).scores == [1.0]


# ---------------------------------------------------------------------------- weights


def test_weighted_components_are_summed_and_logged_separately():
    manager = RewardManager(cfg(fns=["gsm8k", "format:0.2"]))
    good_format = "<think>x</think><answer>#### 5</answer>"
    batch = text_batch([good_format, "#### 5", "#### 4", good_format], ["5", "5", "5", "6"])
    result, m = run(manager, batch)
    # by hand: gsm8k 1,1,0,0 (the answer tag ends after "5"? "#### 5</answer>" reads 5); format 1,0,0,1
    assert result.scores == pytest.approx([1.2, 1.0, 0.0, 0.2])
    assert m["reward/gsm8k"] == pytest.approx(0.5) and m["reward/format"] == pytest.approx(0.5)
    assert m["reward/mean"] == pytest.approx(2.4 / 4)
    assert m["reward/std"] == pytest.approx(math.sqrt((1.44 + 1 + 0 + 0.04) / 4 - 0.6**2))
    assert "acc" not in m


# ---------------------------------------------------------------------------- failures


def test_partial_failures_and_non_finite_rewards_are_counted():
    truths = ["raise"] * 11 + ["nan"] * 2 + ["a", "a", "b"]
    manager = RewardManager(cfg(fn=f"{REWARDS}:flaky"))
    result, m = run(manager, text_batch(["a"] * 16, truths))
    assert result.scores == [0.0] * 13 + [1.0, 1.0, 0.0]
    assert (m["reward/failed"], m["reward/nonfinite"], m["reward/errors"]) == (11, 2, 13)
    assert m["reward/mean"] == pytest.approx(2 / 16)
    line = reward_warning(result.sums, result.errors, step=2)
    assert line.startswith("warning: step 3: the reward function failed on 13 of 16 samples")
    assert "11 failed, 2 non-finite" in line and "ValueError: cannot grade this one" in line


def test_every_sample_failed_is_one_line_and_only_after_the_sum_over_ranks():
    manager = RewardManager(cfg(fn=f"{REWARDS}:always_fails"))
    ok = RewardManager(cfg(fn=f"{REWARDS}:digits"))
    rank0 = manager.score(text_batch(["1", "2"], ["x", "y"]))
    assert rank0.scores == [0.0, 0.0]  # scoring itself never raises
    with pytest.raises(UserError) as e:
        reward_metrics(rank0.sums, rank0.errors)
    msg = str(e.value)
    assert msg.startswith("reward function always_fails failed on every sample: sample 0: RuntimeError:")
    assert "the grading service is down (second line of the message)" in msg and "\n" not in msg
    # another rank scored fine with the same component name? sum the two ranks' dicts: no longer "every"
    rank1 = manager.score(text_batch([], []))
    summed = {k: rank0.sums.get(k, 0) + rank1.sums.get(k, 0) for k in rank0.sums | rank1.sums}
    with pytest.raises(UserError):
        reward_metrics(summed, rank0.errors)
    good = ok.score(text_batch(["12"], ["x"]))
    mixed = dict(rank0.sums)
    mixed["n"] += good.sums["n"]
    assert reward_metrics(mixed, rank0.errors)["reward/failed"] == 2
    assert reward_metrics({"n": 0.0}, {})["reward/mean"] == 0.0  # an empty step is not "every sample failed"


def test_one_component_failing_everywhere_stops_even_when_another_works():
    manager = RewardManager(cfg(fns=["exact", f"{REWARDS}:always_fails:0.1"]))
    result = manager.score(text_batch(["a", "b"], ["a", "a"]))
    with pytest.raises(UserError, match="reward function always_fails failed on every sample"):
        reward_metrics(result.sums, result.errors)


# ---------------------------------------------------------------------------- timeouts and the pool


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hanging_call_times_out_and_counts_as_failed(workers):
    manager = RewardManager(cfg(fn=f"{REWARDS}:flaky", timeout=1.0, workers=workers))
    try:
        began = time.monotonic()
        result, m = run(manager, text_batch(["a", "a", "a", "b"], ["a", "hang", "a", "a"]))
        assert time.monotonic() - began < 10  # not the 60 s of the hanging call
        assert result.scores == [1.0, 0.0, 1.0, 0.0]
        assert (
            m["reward/failed"] == 1
            and "TimeoutError" in result.errors["flaky"]
            and "reward.timeout=1" in (result.errors["flaky"])
        )
        if workers:  # the killed worker was replaced: the pool still scores
            assert manager.score(text_batch(["a", "b"], ["a", "a"])).scores == [1.0, 0.0]
    finally:
        manager.close()


def test_a_worker_that_dies_fails_its_sample_and_is_replaced():
    manager = RewardManager(cfg(fn=f"{REWARDS}:flaky", workers=1))
    try:
        result, m = run(manager, text_batch(["a", "a", "a"], ["a", "exit", "a"]))
        assert result.scores == [1.0, 0.0, 1.0] and m["reward/failed"] == 1
        assert "the reward worker process died" in result.errors["flaky"]
    finally:
        manager.close()


def test_pool_and_serial_agree_on_builtins():
    responses = [f"#### {i % 7}" for i in range(40)]
    truths = [str(i % 5) for i in range(40)]
    serial = RewardManager(cfg(fn="gsm8k", workers=0)).score(text_batch(responses, truths))
    pool = RewardManager(cfg(fn="gsm8k", workers=2))
    try:
        assert pool.score(text_batch(responses, truths)).scores == serial.scores
    finally:
        pool.close()
    assert serial.scores == [float(i % 7 == i % 5) for i in range(40)]


# ---------------------------------------------------------------------------- batch and class rewards


@pytest.mark.parametrize("workers", [0, 1])
def test_verl_batch_reward_function(workers):
    manager = RewardManager(cfg(fn=f"{REWARDS}:batch_match", workers=workers))
    try:
        result, m = run(manager, text_batch(["42", "x 42 y", "7"], ["42", "42", "42"]))
        assert result.scores == [1.0, 0.5, 0.0] and m["reward/failed"] == 0
    finally:
        manager.close()


def test_class_reward_is_built_once_with_the_tokenizer_and_gets_the_batch():
    from rlctl.testing import build_tokenizer

    tok = build_tokenizer()
    manager = RewardManager(cfg(fns=[f"{REWARDS}:LengthReward", "exact:0.5"]), tokenizer=tok)
    obj = manager.components[0].obj
    assert obj.tokenizer is tok
    batch = text_batch(["ab", "abcd", "x" * 20], ["ab", "zz", "zz"])
    result, m = run(manager, batch)
    lengths = [2, 4, 20]
    expected = [1 - min(n, 10) / 10 + 0.5 * (r == t) for n, r, t in zip(lengths, batch.responses, batch.ground_truths)]
    assert result.scores == pytest.approx(expected)
    assert m["reward/LengthReward"] == pytest.approx((0.8 + 0.6 + 0.0) / 3)
    manager.score(batch)
    assert obj.calls == 2  # constructed once, called per batch


# ---------------------------------------------------------------------------- a reward model


@pytest.fixture(scope="module")
def tiny_rm(tmp_path_factory):
    import torch
    from transformers import Qwen2ForSequenceClassification

    from rlctl.testing import build_tokenizer, tiny_qwen2_config

    out = tmp_path_factory.mktemp("rm")
    tok = build_tokenizer(out)
    config = tiny_qwen2_config(vocab_size=len(tok), num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(str(out))
    return out


def test_reward_model_in_micro_batches_combined_with_a_rule(tiny_rm):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    prompts = ["What is 1 + 2?", "What is 10 + 20?", "Hi", "What is 3 + 4?", "x"]
    responses = ["3", "the answer is 30", "hello there friend", "7", "yy"]
    truths = ["3", "31", "a", "7", "z"]
    manager = RewardManager(
        cfg(fns=["exact:0.5"], model=str(tiny_rm), model_weight=2.0, model_micro_batch=2), tokenizer=None
    )
    result, m = run(manager, text_batch(responses, truths, prompts=prompts))
    # independently: the plain HF model, one unpadded sequence at a time
    tok = AutoTokenizer.from_pretrained(str(tiny_rm))
    model = AutoModelForSequenceClassification.from_pretrained(str(tiny_rm)).eval()
    with torch.no_grad():
        rm = [model(**tok(p + r, return_tensors="pt")).logits[0, 0].item() for p, r in zip(prompts, responses)]
    assert len(set(round(v, 4) for v in rm)) == 5  # a real, input-dependent score
    expected = [0.5 * (r == t) + 2.0 * v for r, t, v in zip(responses, truths, rm)]
    assert result.scores == pytest.approx(expected, abs=1e-4)
    assert m["reward/rm"] == pytest.approx(sum(rm) / 5, abs=1e-4) and m["reward/exact"] == pytest.approx(0.4)


def test_reward_model_alone_and_a_bad_dtype(tiny_rm):
    manager = RewardManager(cfg(model=str(tiny_rm), model_dtype="bfloat16"))
    assert [c.name for c in manager.components] == ["rm"]
    assert next(manager.components[0].rm.model.parameters()).dtype.__repr__() == "torch.bfloat16"
    with pytest.raises(UserError, match="model_dtype='float33' is not a torch dtype"):
        RewardManager(cfg(model=str(tiny_rm), model_dtype="float33"))


def test_check_reward_config_fails_fast_in_one_line(tmp_path):
    from rlctl.rewards import check_reward_config

    assert [s.name for s in check_reward_config(cfg(fns=["gsm8k", "format:0.2"]))] == ["gsm8k", "format"]
    bad = [
        (cfg(fns=["gsm8k", "fromat:0.2"]), "unknown reward 'fromat'.*did you mean format"),
        (cfg(timeout=-1.0), r"reward.timeout=-1 must be >= 0"),
        (cfg(workers=-2), "reward.workers=-2"),
        (cfg(model=str(tmp_path / "no-rm")), "reward model .*no-rm not found"),
    ]
    for c, pattern in bad:
        with pytest.raises(UserError, match=pattern) as e:
            check_reward_config(c)
        assert "\n" not in str(e.value)
