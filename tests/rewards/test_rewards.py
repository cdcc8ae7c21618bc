"""Built-in rewards, the reward registry / loader and batch scoring."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest

from rlctl.errors import UserError
from rlctl.rewards import BUILTINS, builtin, default_for_data_source, get_reward, score_batch
from rlctl.rewards.builtin import (
    exact_score,
    extract_gsm8k_answer,
    format_score,
    gsm8k_flexible_score,
    gsm8k_score,
    length_score,
    math_score,
)
from rlctl.rewards.math_normalize import is_equiv, last_boxed, normalize_answer

# ---------------------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### -5", "-5", 1.0),
        ("The total is 42.\n#### 42.", "42", 1.0),
        ("#### $18", "18", 1.0),
        ("#### 71", "72", 0.0),
        ("The answer is 72", "72", 0.0),  # no "#### " marker
        ("####72", "72", 0.0),  # the marker needs its space
        ("#### 3 first try... no wait\n#### 5", "5", 1.0),  # the last marker counts
        ("#### 42.0", "42", 0.0),  # exact string match, as verl
        ("#### 1,000", "1,000", 1.0),  # the ground truth is cleaned the same way
    ],
)
def test_gsm8k_strict(response, truth, expected):
    assert gsm8k_score("openai/gsm8k", response, truth) == expected


def test_gsm8k_reads_only_the_last_300_characters():
    answer = "#### 72"
    assert gsm8k_score("gsm8k", answer + " " + "x" * 292, "72") == 1.0  # 300 chars: still inside
    assert gsm8k_score("gsm8k", answer + " " + "x" * 293, "72") == 0.0  # the "#" falls out
    assert extract_gsm8k_answer("#### 72" + "x" * 300) is None


def test_gsm8k_flexible_takes_the_last_number():
    assert extract_gsm8k_answer("3 apples and then 1,000 pears. ...", "flexible") == "1000"
    assert gsm8k_flexible_score("gsm8k", "so she has -7 left.", "-7") == 1.0
    assert gsm8k_flexible_score("gsm8k", "no numbers here", "7") == 0.0
    with pytest.raises(ValueError, match="strict or flexible"):
        extract_gsm8k_answer("1", "loose")


# ---------------------------------------------------------------------------- MATH


def test_last_boxed_balanced_braces():
    text = r"first \boxed{1}, then finally \boxed{\frac{a}{b^{2}}} done"
    assert last_boxed(text) == r"\frac{a}{b^{2}}"
    assert last_boxed(r"so \fbox{7}.") == "7"
    assert last_boxed(r"$\boxed 5$") == "5"
    assert last_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed(r"\boxed{3} and truncated \boxed{\frac{1}{") is None
    assert last_boxed("no box at all") is None
    assert last_boxed(r"\boxedfoo{3}") is None  # another command, not \boxed


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac{3}{4}", r"\frac{3}{4}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"\frac1{10}", r"\frac{1}{10}"),
        (r"\frac{x}2", r"\frac{x}{2}"),
        (r"10\text{ cm}", "10"),
        (r"\text{(A)}", "(A)"),
        ("2.50", "2.5"),
        ("3.0", "3"),
        (".5", "0.5"),
        ("x = 5", "5"),
        (r"\$1,000", "1000"),
        (r"50\%", "50"),
        (r"90^\circ", "90"),
        (r"\sqrt3", r"\sqrt{3}"),
        (r"3\!\cdot\!4", r"3\cdot4"),
        ("1/2", r"\frac{1}{2}"),
        (r"1{,}000", "1000"),
    ],
)
def test_normalize_answer(raw, normal):
    assert normalize_answer(raw) == normal


def test_is_equiv_numbers_and_strings():
    assert is_equiv("0.5", r"\frac{1}{2}")
    assert is_equiv(r"\frac{2}{4}", r"\frac12")
    assert is_equiv(r"-\frac{3}{2}", "-1.5")
    assert is_equiv(r"(1, 2)", r"\left(1,2\right)")
    assert not is_equiv("0.333", r"\frac{1}{3}")
    assert not is_equiv("(1,2)", "(2,1)")
    assert not is_equiv(r"\frac{1}{0}", "0")


def test_math_score():
    response = r"The probability is $\boxed{\dfrac{1}{2}}$."
    assert math_score("lighteval/MATH", response, r"\frac12") == 1.0
    assert math_score("lighteval/MATH", response, "0.5") == 1.0
    assert math_score("lighteval/MATH", response, r"\frac{1}{3}") == 0.0
    assert math_score("lighteval/MATH", "the answer is 1/2", "1/2") == 0.0  # no box, no score
    assert math_score("lighteval/MATH", r"\boxed{4}", r"so it is \boxed{4}.") == 1.0  # boxed truth


@pytest.fixture
def fake_math_verify(monkeypatch):
    """A stand-in ``math_verify`` (parse/verify) recording its calls."""
    calls = []
    fake = types.ModuleType("math_verify")

    def parse(text, **kw):
        calls.append(text)
        if "crash" in text:
            raise RuntimeError("parser crash")
        return text.removeprefix("\\boxed{").removesuffix("}").replace(" ", "")

    def verify(gold, pred, **kw):  # "symbolic" check: same multiset of characters
        return sorted(gold) == sorted(pred)

    fake.parse, fake.verify = parse, verify
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    builtin._math_verify.cache_clear()
    yield calls
    builtin._math_verify.cache_clear()


def test_math_uses_math_verify_when_installed(fake_math_verify):
    assert math_score("math", r"\boxed{x+1}", "1+x") == 1.0  # our normaliser alone says no
    assert r"\boxed{x+1}" in fake_math_verify and r"\boxed{1+x}" in fake_math_verify
    assert math_score("math", r"\boxed{x+2}", "1+x") == 0.0
    assert math_score("math", r"\boxed{crash}", "1+x") == 0.0  # a library failure is "not equal"


def test_math_without_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails
    builtin._math_verify.cache_clear()
    try:
        assert builtin._math_verify() is None
        assert math_score("math", r"\boxed{x+1}", "1+x") == 0.0
        assert math_score("math", r"\boxed{0.5}", r"\frac{1}{2}") == 1.0
    finally:
        builtin._math_verify.cache_clear()


# ---------------------------------------------------------------------------- exact, format, length


def test_exact():
    assert exact_score("qa", "  Paris. ", "paris") == 1.0
    assert exact_score("qa", "Let me think.\nThe   Answer:  PARIS!", "Paris") == 1.0
    assert exact_score("qa", "Lyon", "Paris") == 0.0
    assert exact_score("qa", "paris is the capital", "Paris") == 0.0


def test_format():
    assert format_score("x", "<think>a\nb</think>\n<answer>1</answer>", None) == 1.0
    assert format_score("x", "reasoning</think><answer>1</answer>", None) == 1.0  # <think> in prompt
    assert format_score("x", "<answer>1</answer>", None) == 0.0
    assert format_score("x", "<think>a</think><answer>1</answer> and more", None) == 0.0
    assert format_score("x", "42", None, {"pattern": r"^\d+$"}) == 1.0
    assert format_score("x", "42 apples", None, {"pattern": r"^\d+$"}) == 0.0


def test_length():
    info = {"target_length": 10}
    assert length_score("x", "a" * 5, None, info) == 1.0
    assert length_score("x", "a" * 15, None, info) == 0.5  # 5 over a target of 10
    assert length_score("x", "a" * 25, None, info) == 0.0
    assert length_score("x", "a" * 1024, None) == 1.0  # default target 1024


# ---------------------------------------------------------------------------- registry / loader


def test_builtin_names_and_defaults():
    assert get_reward("gsm8k") is gsm8k_score and get_reward("math") is math_score
    assert set(BUILTINS) == {"gsm8k", "gsm8k_flexible", "math", "exact", "format", "length"}
    assert default_for_data_source("openai/gsm8k") == "gsm8k"
    assert default_for_data_source("gsm8k") == "gsm8k"
    assert default_for_data_source("lighteval/MATH") == "math"
    assert default_for_data_source("DigitalLearningGmbH/MATH-lighteval") == "math"
    assert default_for_data_source("math") == "math"
    assert default_for_data_source("my/custom") is None


def test_unknown_builtin_suggests():
    with pytest.raises(UserError, match="did you mean gsm8k") as err:
        get_reward("gsm8")
    assert "math" in str(err.value) and "file.py" in str(err.value)


REWARD_FILE = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str.strip() == ground_truth)

    def by_length(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": 1.0, "length": len(solution_str)}
    """
)


def test_custom_reward_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    fn = get_reward(str(path))  # verl's default function name: compute_score
    assert fn("x", " 7 ", "7") == 1.0
    assert get_reward(f"{path}:by_length")("x", "abc", None) == {"score": 1.0, "length": 3}
    with pytest.raises(UserError, match="no function 'by_lenght'.*did you mean by_length"):
        get_reward(f"{path}:by_lenght")
    with pytest.raises(UserError, match="nope.py not found"):
        get_reward(f"{tmp_path}/nope.py:compute_score")
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(UserError, match="broken.py failed to import: SyntaxError"):
        get_reward(str(broken))


def test_custom_reward_from_module(tmp_path, monkeypatch):
    package = tmp_path / "rlctl_test_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text(REWARD_FILE + "\nNOT_A_FUNCTION = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = get_reward("rlctl_test_pkg.scores:compute_score")
    assert fn("x", "7", "7") == 1.0
    with pytest.raises(UserError, match="rlctl_test_pkg.nothere.*not found"):
        get_reward("rlctl_test_pkg.nothere:compute_score")
    with pytest.raises(UserError, match="not a function"):
        get_reward("rlctl_test_pkg.scores:NOT_A_FUNCTION")


# ---------------------------------------------------------------------------- score_batch


def _batch(solutions):
    n = len(solutions)
    return ["src"] * n, solutions, ["gt"] * n, [None] * n


def by_keyword(results: dict):
    """A reward as verl calls it (by keyword): the result for each solution_str."""

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return results[solution_str]

    return fn


def test_score_batch_result_kinds_and_extras():
    results = {
        "a": 1.0,
        "b": True,
        "c": 0,
        "d": {"score": 0.5, "acc": 1, "pred": "x"},
        "e": {"score": 2, "acc": 0.0},
    }
    scores, extras, n_errors, first = score_batch(by_keyword(results), *_batch(list("abcde")))
    assert scores == [1.0, 1.0, 0.0, 0.5, 2.0]
    assert all(type(s) is float for s in scores)
    assert extras == {"acc": [None, None, None, 1.0, 0.0]}  # aligned; the string "pred" is dropped
    assert (n_errors, first) == (0, None)


def test_score_batch_one_failure_scores_zero():
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "bad":
            raise RuntimeError("cannot parse")
        return 1.0

    scores, _, n_errors, first = score_batch(flaky, *_batch(["ok", "bad", "ok"]))
    assert scores == [1.0, 0.0, 1.0]
    assert n_errors == 1 and first == "sample 1: RuntimeError: cannot parse"


@pytest.mark.parametrize("bad", ["yes", float("nan"), {"acc": 1.0}, None])
def test_score_batch_invalid_results_are_errors(bad):
    results = {"good": 1.0, "bad": bad}
    scores, _, n_errors, first = score_batch(by_keyword(results), *_batch(["good", "bad"]))
    assert scores == [1.0, 0.0] and n_errors == 1 and first.startswith("sample 1:")


def test_score_batch_counts_every_failure_without_deciding():
    """score_batch only counts; stopping the run is reward_metrics' (tests/rewards/test_manager.py)."""

    def always_fails(data_source, solution_str, ground_truth, extra_info=None):
        raise KeyError("answer")

    assert score_batch(always_fails, *_batch(["a", "b"])) == ([0.0, 0.0], {}, 2, "sample 0: KeyError: 'answer'")
    assert score_batch(always_fails, [], [], [], []) == ([], {}, 0, None)


def test_score_batch_with_builtin_and_length_check():
    scores, _, n_errors, _ = score_batch(
        get_reward("gsm8k"), ["openai/gsm8k"] * 2, ["#### 5", "#### 6"], ["5", "5"], None
    )
    assert scores == [1.0, 0.0] and n_errors == 0
    with pytest.raises(ValueError, match="2 solutions"):
        score_batch(gsm8k_score, ["a"], ["x", "y"], ["1", "2"])


# ---------------------------------------------------------------------------- math with the real math-verify

EQUIVALENT = [
    (r"\frac{\sqrt2}{2}", r"\frac1{\sqrt2}"),
    ("2x+1", "1+2x"),
    (r"\pi/2", r"\frac{\pi}{2}"),
    (r"10\%", "0.1"),
    (r"\{1,2\}", r"\{2,1\}"),
    ("x^2", "x^{2}"),
    (r"\sqrt{8}", r"2\sqrt{2}"),
    (r"\dfrac{3}{4}", "0.75"),
    ("(x+1)^2", "x^2+2x+1"),
    (r"\frac{1}{3}+\frac{1}{6}", r"\frac12"),
]
NOT_EQUIVALENT = [
    ("3", "4"),
    ("2x+1", "2x-1"),
    (r"\frac{\pi}{3}", r"\frac{\pi}{2}"),
    (r"\{1,2\}", r"\{1,3\}"),
    ("x^2", "x^3"),
    ("(1,2)", "[1,2]"),
    (r"\sqrt{2}", "1.41"),
]


@pytest.mark.parametrize("prediction,truth", EQUIVALENT)
def test_math_real_library_equivalent(prediction, truth):
    builtin._math_verify.cache_clear()
    assert builtin._math_verify() is not None, "math-verify is a core dependency: pip install math-verify"
    assert math_score("math", f"so the answer is $\\boxed{{{prediction}}}$.", truth) == 1.0


@pytest.mark.parametrize("prediction,truth", NOT_EQUIVALENT)
def test_math_real_library_not_equivalent(prediction, truth):
    builtin._math_verify.cache_clear()
    assert math_score("math", f"\\boxed{{{prediction}}}", truth) == 0.0
