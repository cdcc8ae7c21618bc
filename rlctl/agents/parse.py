"""Tool calls out of a model's response text, in its chat template's format (no torch).

Styles:

* ``hermes``: Hermes / Qwen ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number;
* ``llama3``: Llama 3.x JSON tool calls, the whole message ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``; several separated by ``;``);
* ``tokenizer``: the tokenizer's own ``parse_response`` (transformers, when the tokenizer carries a
  ``response_schema``).

:func:`detect_style` picks the style from the chat template. A call that cannot be read (bad JSON, no name,
arguments that are not an object, an unclosed ``<tool_call>``) is counted as malformed, never raised.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

ToolCallStyle = Literal["hermes", "llama3", "tokenizer"]
STYLES: tuple[str, ...] = ("hermes", "llama3", "tokenizer")

_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def _tool_call(name: object, arguments: object, index: int):
    """A ToolCall, or None when the name or the arguments are not usable."""
    from rlctl.agents.calls import ToolCall

    if isinstance(arguments, str):  # some models emit the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=arguments, id=f"call_{index}")


def _from_json(body: str, index: int, args_key: str = "arguments"):
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters")))
    return _tool_call(obj.get("name"), args, index)


def _hermes(text: str) -> tuple[list, int]:
    calls, malformed = [], 0
    for match in _HERMES.finditer(text):
        call = _from_json(match.group(1).strip(), len(calls)) if match.group(2) else None
        if call is None:
            malformed += 1
        else:
            calls.append(call)
    return calls, malformed


def _llama3(text: str) -> tuple[list, int]:
    body = text.replace("<|python_tag|>", "").strip()
    for end in ("<|eom_id|>", "<|eot_id|>"):
        body = body.removesuffix(end).strip()
    if not body.startswith("{"):
        return [], 0
    calls, malformed = [], 0
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return calls, malformed + 1
        call = None
        if isinstance(obj, dict):
            call = _tool_call(obj.get("name"), obj.get("parameters", obj.get("arguments")), len(calls))
        if call is None:
            malformed += 1
        else:
            calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return calls, malformed


def _with_tokenizer(text: str, tokenizer: Any) -> tuple[list, int]:
    try:
        message = tokenizer.parse_response(text)
    except Exception:
        return [], 1
    calls, malformed = [], 0
    for entry in (message or {}).get("tool_calls") or []:
        fn = entry.get("function", entry) if isinstance(entry, dict) else None
        call = _tool_call(fn.get("name"), fn.get("arguments"), len(calls)) if isinstance(fn, dict) else None
        if call is None:
            malformed += 1
        else:
            calls.append(call)
    return calls, malformed


def parse_tool_calls(text: str, style: ToolCallStyle, tokenizer: Any = None) -> tuple[list, int]:
    """(the tool calls in ``text``, how many could not be read). ``tokenizer`` only for style ``tokenizer``."""
    if style == "hermes":
        return _hermes(text)
    if style == "llama3":
        return _llama3(text)
    if style == "tokenizer":
        return _with_tokenizer(text, tokenizer)
    raise ValueError(f"unknown tool call style {style!r}; one of {', '.join(STYLES)}")


def content_before_calls(text: str, style: ToolCallStyle) -> str:
    """The assistant's text without its tool calls (the ``content`` of its message)."""
    if style == "hermes":
        return _HERMES.sub("", text).strip()
    if style == "llama3" and text.replace("<|python_tag|>", "").strip().startswith("{"):
        return ""
    return text.strip()


def detect_style(tokenizer: Any) -> ToolCallStyle | None:
    """The tool call style of the tokenizer's chat template, or None when the template takes no tools."""
    if getattr(tokenizer, "response_schema", None):
        return "tokenizer"
    return template_style(getattr(tokenizer, "chat_template", None))


def template_style(template: str | dict | None) -> ToolCallStyle | None:
    """The tool call style a chat template's text writes (None: it renders no tool calls)."""
    template = template or ""
    if isinstance(template, dict):  # named templates: the tool-use one, else the default
        template = template.get("tool_use") or template.get("default") or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return None
