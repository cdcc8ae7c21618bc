"""Agent tests: one tiny tool-calling model for all of them."""

from __future__ import annotations

from pathlib import Path

import pytest

ADD_SCHEMA = {  # what rlctl.agents.tools makes of TOOLS_FILE (test_loop checks it)
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "The first integer."},
                "b": {"type": "integer", "description": "The second integer."},
            },
            "required": ["a", "b"],
        },
        "return": {"type": "integer"},
    },
}
# what the memorizing model emits: compact JSON, which the template would re-render with spaces and newlines
CALL_TEXT = '<tool_call>{"name":"add","arguments":{"a":3,"b":4}}</tool_call>'
TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b
'''


def trace_messages() -> list[dict]:
    return [
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": CALL_TEXT},
        {"role": "tool", "name": "add", "content": "7"},
        {"role": "assistant", "content": "The answer is 7."},
    ]


def _memorize(model_dir: Path, steps: int = 120) -> None:
    """Train the tiny model on one tool-using conversation until it reproduces it: a real policy that calls
    the tool, so the loop's tool path runs (a random model never emits a call)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    # the assistant's call as the model writes it (raw text), then the template's own tool turn
    text = tok.apply_chat_template(trace_messages()[:2], tools=[ADD_SCHEMA], tokenize=False)
    rest = tok.apply_chat_template(trace_messages(), tools=[ADD_SCHEMA], tokenize=False)
    ids = torch.tensor([tok(text + rest[len(text) :], add_special_tokens=False)["input_ids"]])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(str(model_dir), safe_serialization=True)


@pytest.fixture(scope="session")
def agent_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 whose template takes tools, trained to call ``add`` then answer (one model for every test)."""
    from rlctl.testing import build_tiny_model

    out = build_tiny_model(tmp_path_factory.mktemp("agent") / "model", seed=0, tools=True)
    _memorize(out)
    return out
