"""A tool call, its outcome, one trajectory's tool, and the texts the model sees of results and errors (no torch).

Each source of tools (:mod:`rlctl.agents.sources`) writes its results and errors in its peer's words: TRL's,
verl's or rlctl's (``agent.tool_results`` picks one for all); those texts are written here, once.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Tool", "ToolCall", "ToolOutcome", "error_content", "result_text", "tool_text"]

Status = Literal["ok", "error", "timeout", "unknown_tool"]


@dataclass(frozen=True)
class ToolCall:
    """One parsed call."""

    name: str
    arguments: dict
    id: str = ""


@dataclass(frozen=True)
class ToolOutcome:
    content: str  # the text the model sees in the tool message (error text for failures)
    status: Status
    reward: float = 0.0  # a verl tool's step reward (0 for plain functions)


@dataclass(frozen=True)
class Tool:
    """One tool of one trajectory: ``run(arguments)`` (may return an awaitable), ``interpret(value) ->
    (text, step reward)``, and the signature that checks the arguments (None: the tool checks them); or
    ``hosted(arguments, timeout_s) -> Result``, a sync-host call whose value is already text. ``style``: whose
    text its results and errors take (:func:`result_text`, :func:`error_content`)."""

    run: Callable[[dict], Any] | None
    interpret: Callable[[Any], tuple[str, float]] | None
    signature: inspect.Signature | None = None
    style: str = "rlctl"
    hosted: Callable[[dict, float], Any] | None = None


def result_text(value: Any, style: str) -> str:
    """A tool's value as the model sees it: TRL's ``str(result)``, else :func:`tool_text` (JSON)."""
    return str(value) if style == "trl" else tool_text(value)


def error_content(style: str, name: str, kind: str, message: str) -> str:
    """What the model sees of a failed call ``name`` (``kind``: the exception's type): TRL's
    ``str({"error": message})``, verl's ``Error executing tool 'name': message``, or rlctl's
    ``Error: Type: message`` (``Error: Type`` when the exception has no message)."""
    if style == "trl":
        return str({"error": message})
    if style == "verl":
        return f"Error executing tool '{name}': {message}"
    return f"Error: {kind}: {message}" if kind and message else f"Error: {kind or message}"


def tool_text(value: Any) -> str:
    """What the model sees of a tool's return value: text as is, verl's ToolResponse by its text,
    anything else as JSON (or its str)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    text = getattr(value, "text", None)
    if isinstance(text, str) or (text is None and type(value).__name__ == "ToolResponse"):
        return text or ""
    if isinstance(value, dict) and set(value) <= {"text", "image", "video"} and "text" in value:
        return str(value["text"] or "")
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)
