"""Tool calls out of response text: the Hermes/Qwen and Llama 3 formats, malformed calls counted."""

from __future__ import annotations

import pytest

from rlctl.agents.parse import content_before_calls, detect_style, parse_tool_calls


def _calls(text, style):
    calls, malformed = parse_tool_calls(text, style)
    return [(c.name, c.arguments) for c in calls], malformed


def test_hermes_calls_several_and_malformed():
    text = (
        'Let me add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>\n{"name": "mul", "arguments": "{\\"x\\": 3}"}\n</tool_call>'
    )
    assert _calls(text, "hermes") == ([("add", {"a": 1, "b": 2}), ("mul", {"x": 3})], 0)
    assert content_before_calls(text, "hermes") == "Let me add."
    assert _calls("no call here", "hermes") == ([], 0)
    bad = [
        '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>',  # bad JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "add", "arguments": {}}',  # never closed
    ]
    for text in bad:
        assert _calls(text, "hermes") == ([], 1), text
    mixed = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>oops</tool_call>'
    assert _calls(mixed, "hermes") == ([("f", {})], 1)
    calls, _ = parse_tool_calls(mixed, "hermes")
    assert calls[0].id == "call_0"


def test_llama3_json_calls():
    assert _calls('{"name": "add", "parameters": {"a": 1, "b": 2}}', "llama3") == ([("add", {"a": 1, "b": 2})], 0)
    two = '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"x": 1}}<|eom_id|>'
    assert _calls(two, "llama3") == ([("f", {}), ("g", {"x": 1})], 0)
    assert _calls("The answer is 3.", "llama3") == ([], 0)
    assert _calls('{"name": "f", "parameters": {', "llama3") == ([], 1)
    assert _calls('{"parameters": {}}', "llama3") == ([], 1)


def test_style_detected_from_the_chat_template():
    class Tok:
        response_schema = None

        def __init__(self, template):
            self.chat_template = template

    from rlctl.testing import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE

    assert detect_style(Tok(TOOL_CHAT_TEMPLATE)) == "hermes"
    assert detect_style(Tok("{{ '<|python_tag|>' }}")) == "llama3"
    assert detect_style(Tok(CHAT_TEMPLATE)) is None
    with pytest.raises(ValueError):
        parse_tool_calls("x", "nope")  # type: ignore[arg-type]


def test_pre_launch_one_liners(tiny_model_dir, tmp_path):
    """--max-turns without tools, and tools with a chat template that renders no tool calls: one line each."""
    from tests.support.cli import run_cli
    from tests.support.rl import error_line
    from tests.support.sft import write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "What is 1 + 2?", "answer": "3"}])
    tools = tmp_path / "tools.py"
    tools.write_text(
        "def add(a: int, b: int) -> int:\n    '''Add.\n\n    Args:\n        a: A.\n        b: B.\n    '''\n"
    )
    base = ["grpo", "--model", str(tiny_model_dir), "--data", str(data), "--device", "cpu", "--max-steps", "1"]
    base += ["--max-prompt-len", "64", "--max-response-len", "64", "--reward", "exact"]
    res = run_cli(*base, "--max-turns", "3", "--dry-run")
    assert res.returncode == 2 and "--max-turns needs something to take turns with" in error_line(res)
    res = run_cli(*base, "--tools", str(tools), "--output-dir", str(tmp_path / "run"))
    assert res.returncode == 2 and "the chat template has no tool-call format" in error_line(res), res.stderr


def test_console_conversation_lines():
    from rlctl.launch import conversation

    messages = [
        {"role": "system", "content": "tools..."},
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 3}}}]},
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "assistant", "content": "It is 7."},
    ]
    assert conversation(messages) == [
        ("user", "What is 3 + 4?"),
        ("assistant", '-> add({"a": 3})'),
        ("tool", "7"),
        ("assistant", "It is 7."),
    ]
