"""One multi-turn trajectory and the token delta of appended messages (no torch).

A :class:`Trajectory` holds the tokens the policy is trained on: the prompt's ids, then the response, the
tokens the rollout engine sampled (loss mask 1, their rollout log-probs) interleaved with the tokens of tool,
environment and user turns (mask 0, log-prob 0). Nothing is ever re-tokenized: sampled tokens are kept as the
engine returned them, and appended turns are the chat template's own rendering of the new messages, taken as a
token delta (:func:`render_delta`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlctl.agents.calls import ToolCall

FINISH_REASONS = ("stop", "length", "max_turns", "malformed")


class TemplateDeltaError(ValueError):
    """The chat template renders a conversation's prefix differently once messages are appended."""


@dataclass(frozen=True)
class ToolTurn:
    """What a going trajectory appends next: the results of the tool calls its last turn made."""

    calls: tuple[ToolCall, ...]


@dataclass(frozen=True)
class UserTurn:
    """What a going trajectory appends next: the simulated user's reply (a verl interaction)."""

    reply: str


@dataclass
class Trajectory:
    """Prompt ids, then the response: sampled tokens (mask 1) and appended turns (mask 0)."""

    prompt_ids: list[int]
    prompt_index: int = 0  # the prompt it answers, in the batch given to the loop
    messages: list[dict] = field(default_factory=list)  # the prompt's messages, then the turns (roles, tool calls)
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0  # assistant turns sampled
    finish_reason: str = "stop"  # one of FINISH_REASONS
    tool_calls: int = 0
    tool_errors: int = 0  # calls that raised, or named an unknown tool
    tool_timeouts: int = 0
    malformed: int = 0  # calls that could not be parsed (each ends the trajectory)
    rewards: dict[str, float] = field(default_factory=dict)  # the environment's named reward components
    # tool / user turns that ran but were not appended (no room left under max_response_len): the policy
    # never read them, so they are not in ``messages``; logs show them marked dropped (:meth:`logged_messages`)
    dropped: list[dict] = field(default_factory=list)
    pending: ToolTurn | UserTurn | None = None  # what it appends next while it goes on (the loop's)

    def add_sampled(self, token_ids: list[int], logprobs: list[float]) -> None:
        self.token_ids += token_ids
        self.mask += [1] * len(token_ids)
        self.logprobs += [float(x) for x in logprobs]
        self.turns += 1

    def add_context(self, token_ids: list[int]) -> None:
        """Tokens of a tool, environment or user turn: context only (mask 0, not trained on)."""
        self.token_ids += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)

    @property
    def history(self) -> list[int]:
        """Everything the model has seen so far: the prompt and the response."""
        return self.prompt_ids + self.token_ids

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    def logged_messages(self) -> list[dict]:
        """The conversation as logs show it: what the policy read, then the dropped turns marked ``dropped``."""
        return [*self.messages, *({**m, "dropped": True} for m in self.dropped)]

    def tool_call_list(self) -> list[dict]:
        """Every tool call of the trajectory, in order ({"name", "arguments"})."""
        return [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for m in self.messages
            if m.get("role") == "assistant"
            for c in m.get("tool_calls") or ()
        ]


def assistant_message(content: str, calls: list[ToolCall]) -> dict:
    """The assistant's turn as an OpenAI/HF chat message (``tool_calls`` when it called tools)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [
            {"type": "function", "id": c.id, "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    return message


def _ids(tokenizer, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_delta(
    tokenizer, assistant: dict, appended: list[dict], *, tools: list[dict] | None, stop_ids: set[int]
) -> list[int]:
    """The tokens the chat template puts after an assistant turn that ended on a stop token: ``appended``
    (tool results or a user reply) and the next generation prompt.

    Rendered as the difference of two renderings, ``[user, assistant]`` and ``[user, assistant, *appended]``
    (with the generation prompt), after checking that the first is a prefix of the second. The delta starts
    right after the assistant's last stop token in the first rendering, so what a template writes after its
    end-of-turn token (ChatML's newline) is kept, and nothing of the sampled turn is re-rendered."""
    base = [{"role": "user", "content": "."}, assistant]
    prefix = _ids(tokenizer, base, tools, False)
    full = _ids(tokenizer, base + appended, tools, True)
    if full[: len(prefix)] != prefix:
        raise TemplateDeltaError(
            "the chat template renders the conversation differently once tool/user messages are appended; "
            "its tool messages cannot be appended as tokens"
        )
    cut = len(prefix)
    user_len = len(_ids(tokenizer, base[:1], tools, False))  # the stop token searched in the assistant's part
    for i in range(len(prefix) - 1, user_len - 1, -1):
        if prefix[i] in stop_ids:
            cut = i + 1
            break
    return full[cut:]
