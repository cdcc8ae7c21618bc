"""SFT on tool traces (OpenAI/HF chat rows with tool_calls and tool messages): the loss covers the
assistant turns (their tool calls included) and never the tool results, checked against a hand computation."""

from __future__ import annotations

import json

import pytest

from rlctl.config import build_config
from rlctl.data.sft import IGNORE, make_example, row_tokens
from rlctl.testing import build_tokenizer

# Qwen2.5's tool rendering, reduced: schemas in the system turn, calls as <tool_call>{json}</tool_call>,
# tool results as <tool_response> in a user turn.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for tc in m.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SCHEMA = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


@pytest.fixture(scope="module")
def tok():
    t = build_tokenizer()
    t.chat_template = TEMPLATE
    return t


def _row() -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 17, "b": 23}'}}
    return {
        "tools": json.dumps([SCHEMA]),  # as a datasets column often stores it
        "messages": [
            {"role": "user", "content": "What is 17 * 23?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},  # OpenAI: null content, JSON arguments
            {"role": "tool", "tool_call_id": "c1", "content": "391"},
            {"role": "assistant", "content": "17 * 23 = 391. #### 391"},
        ],
    }


def test_tool_trace_labels_cover_the_assistant_turns_only(tok):
    # The conversation written out by hand: (text, trained?) pieces.
    pieces = [
        ("<|im_start|>system\n<tools>" + json.dumps(SCHEMA) + "</tools><|im_end|>\n", False),  # trim_blocks
        ("<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ('<tool_call>\n{"name": "multiply", "arguments": {"a": 17, "b": 23}}\n</tool_call><|im_end|>\n', True),
        ("<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n", False),
        ("<|im_start|>assistant\n", False),
        ("17 * 23 = 391. #### 391<|im_end|>\n", True),
    ]
    expected_ids, trained = [], []
    for text, on in pieces:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        expected_ids += ids
        trained += [on] * len(ids)
    expected_labels = [expected_ids[j + 1] if trained[j + 1] else IGNORE for j in range(len(expected_ids) - 1)]
    expected_labels.append(IGNORE)

    cfg = build_config("sft", [])
    ids, mask = row_tokens(_row(), tok, cfg)
    assert ids == expected_ids  # the schema reached the template, the JSON arguments were parsed
    example = make_example(ids, mask, max_len=4096, truncation="skip")
    assert example.labels.tolist() == expected_labels
    assert tok.decode([t for t, m in zip(ids, mask) if m]).count("391") == 2  # the call's answer, not the result


def test_tool_trace_without_tool_support_in_the_template_is_a_bad_row(tok):
    from rlctl.data.sft import BadRow
    from rlctl.testing import CHAT_TEMPLATE

    plain = build_tokenizer()
    plain.chat_template = CHAT_TEMPLATE
    with pytest.raises(BadRow, match="no tool support"):
        row_tokens(_row(), plain, build_config("sft", []))
    bad = _row()
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(BadRow, match="not JSON"):
        row_tokens(bad, tok, build_config("sft", []))
