"""The calculator example's pieces (examples/calculator): the tool, the reward, its SFT traces and the
evaluation's call handling. The example itself is a benchmark (docs/benchmarks.md), not a test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "calculator"


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import run

        yield run
    finally:
        sys.path.remove(str(EXAMPLE))


def test_calculator_tool_and_its_schema(example):
    from calc import calculator

    from rlctl.agents.tools import ToolCall, load_agent_spec

    assert calculator("17 * 23") == "391" and calculator("7 / 2") == "3.5" and calculator("-(2 + 3) * 4") == "-20"
    with pytest.raises(ValueError, match="not an arithmetic expression"):
        calculator("__import__('os')")
    spec = load_agent_spec(tools=str(EXAMPLE / "calc.py"), results="rlctl")  # as run.py runs it
    assert spec.tool_names == ["calculator"]
    episode = spec.open({})
    assert (
        episode.call(ToolCall("calculator", {"expression": "1 / 0"})).content
        == "Error: ZeroDivisionError: division by zero"
    )


def test_reward_reads_the_final_assistant_turn():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from reward import compute_score
    finally:
        sys.path.remove(str(EXAMPLE))
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 * 3"}}}
    talk = [{"role": "user", "content": "What is 2 * 3?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    talk.append({"role": "tool", "content": "6"})
    assert compute_score("calculator", "...6...", "6", {"messages": talk}) == 0.0  # stopped after the call
    assert (
        compute_score("calculator", "...6 6", "6", {"messages": [*talk, {"role": "assistant", "content": " 6"}]}) == 1
    )
    assert compute_score("calculator", "6", "6", None) == 1.0 and compute_score("calculator", "7", "6", {}) == 0.0


def test_tool_traces_train_on_the_call_and_the_answer(example):
    from rlctl.config import build_config
    from rlctl.data.sft import row_tokens
    from rlctl.testing import build_tokenizer

    tok = build_tokenizer(corpus=["What is * ?", "<tool_call> calculator </tool_call>"])
    tok.chat_template = example.CHAT_TEMPLATE
    ids, mask = row_tokens(
        example.tool_trace(example.Problem(82, 57), example.tool_schemas()), tok, build_config("sft", [])
    )
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "82 * 57"}}\n</tool_call><|im_end|>\n'
        "4674<|im_end|>\n"
    )
    assert "<tools>calculator</tools>" in tok.decode(ids)
    messages = example._call_messages(
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "82 * 57"}}\n</tool_call>',
        '{"name": "calculator", "arguments": {"expression": "82 * 57"}}',
    )
    assert messages[1] == {"role": "tool", "content": "4674"}
    broken = example._call_messages("<tool_call>{nope}</tool_call>", "{nope}")
    assert broken[1]["content"].startswith("Error: JSONDecodeError")
