"""One trajectory's tools and state: an :class:`Episode`, which its sources fill through its methods
(:meth:`Episode.add_tool`, :meth:`~Episode.add_reward`, :meth:`~Episode.add_closer`, :meth:`~Episode.set_interaction`)
and the loop then calls. Every call of a user's code is guarded (:mod:`rlctl.agents.guard`): it never raises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from rlctl.agents.calls import Tool, ToolCall, ToolOutcome, error_content
from rlctl.agents.guard import Result, guarded
from rlctl.agents.sync_host import EpisodeHost
from rlctl.errors import did_you_mean, one_line

__all__ = ["Episode"]


class Episode:
    """One trajectory's tools and state. Every method runs the user's code with the episode's timeout and
    never raises; failures outside tool calls (a reward, a user turn, close) are listed in ``errors``."""

    def __init__(self, schemas: list[dict], timeout_s: float, results: str | None = None):
        self.schemas = schemas
        self.results = results  # agent.tool_results: None = each source its peer's (TRL's, verl's)
        self.prompt_suffix: str | None = None  # what an environment's reset() appends to the prompt
        self.timeout_s = float(timeout_s)
        self.turn_scores: list[float] = []  # verl interaction: each user turn's score
        self.messages: list[dict] = []  # the conversation so far (the loop's; verl's agent_data.messages)
        self.errors: list[str] = []
        self._tools: dict[str, Tool] = {}
        self._rewards: list[tuple[str, Callable[[], Any]]] = []
        self._closers: list[Callable[[], Any]] = []
        self._interaction: Callable[[list[dict]], Any] | None = None
        self._lock = threading.Lock()  # an environment's methods never run concurrently
        self._closed = False
        self._host: EpisodeHost | None = None

    # ------------------------------------------------------------------ filled by the sources

    def add_tool(self, name: str, tool: Tool) -> None:
        self._tools[name] = tool

    def add_reward(self, name: str, fn: Callable[[], Any]) -> None:
        """A reward component ``name``: ``fn()`` is its value (a :class:`Result` when it runs on the sync host)."""
        self._rewards.append((name, fn))

    def add_closer(self, fn: Callable[[], Any]) -> None:
        """Run when the trajectory ends (a verl release, an interaction's finalize)."""
        self._closers.append(fn)

    def set_interaction(self, fn: Callable[[list[dict]], Any]) -> None:
        """The simulated user: ``fn(messages) -> (done, reply, score)``."""
        self._interaction = fn

    def sync_host(self) -> EpisodeHost:
        """The worker process of this trajectory's sync tools and environment (rlctl.agents.sync_host)."""
        if self._host is None:
            self._host = EpisodeHost(self.timeout_s)
        return self._host

    def style_for(self, peer: str) -> str:
        """Whose text a source's results and errors take: agent.tool_results, else the source's peer's."""
        return self.results or peer

    @property
    def tool_names(self) -> list[str]:
        return list(self._tools)

    # ------------------------------------------------------------------ called by the loop

    def call(self, call: ToolCall, timeout_s: float | None = None) -> ToolOutcome:
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        tool, name = self._tools.get(call.name), call.name
        if tool is None:
            style = self.style_for("trl" if self._host else "verl")  # Python tools: TRL's words
            names, hint = ", ".join(self._tools) or "none", did_you_mean(name, self._tools)
            message = (
                f"Tool {name} not found." if style == "trl" else f"unknown tool {name!r}{hint}; the tools are: {names}"
            )
            return ToolOutcome(error_content(style, name, "", message), "unknown_tool")
        if not isinstance(call.arguments, dict):
            message = f"the arguments of {name} must be a JSON object"
            return ToolOutcome(error_content(tool.style, name, "", message), "error")
        if tool.signature is not None and tool.style == "rlctl":  # TRL and verl let the call raise
            try:
                tool.signature.bind(**call.arguments)
            except TypeError as exc:
                return ToolOutcome(f"Error: invalid arguments for {name}: {one_line(exc)}", "error")
        if tool.hosted is not None:
            return _outcome(tool.hosted(call.arguments, timeout), tool, name, timeout, interpret=False)
        return _outcome(guarded(lambda: tool.run(call.arguments), timeout, self._lock), tool, name, timeout)

    def user_turn(self, messages: list[dict]) -> tuple[bool, str | None]:
        """verl Interaction: ``(done, reply)`` after an assistant turn; ``(False, None)`` without one.
        A failing interaction ends the episode: ``(True, None)``."""
        if self._interaction is None:
            return False, None
        interaction = self._interaction
        result = guarded(lambda: interaction(messages), self.timeout_s, self._lock)
        try:
            if not result.ok:
                raise RuntimeError(result.why(self.timeout_s))
            done, reply, score = result.value[0], result.value[1], result.value[2]
            self.turn_scores.append(float(score or 0.0))
            return bool(done), None if reply is None else str(reply)
        except Exception as exc:  # noqa: BLE001
            self.errors.append(f"interaction: {one_line(exc)}")
            return True, None

    def reward(self) -> dict[str, float]:
        """Named components: ``env`` (get_reward), each verl tool's calc_reward, ``interaction`` (the last
        turn's score). A component that fails or runs over is 0.0 and listed in ``errors``."""
        out: dict[str, float] = {}
        for name, fn in self._rewards:
            hosted = isinstance(getattr(fn, "__self__", None), EpisodeHost)
            result = fn() if hosted else guarded(fn, self.timeout_s, self._lock)
            try:
                if not result.ok:
                    raise RuntimeError(result.why(self.timeout_s))
                out[name] = float(result.value)
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"reward {name}: {one_line(exc)}")
                out[name] = 0.0
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fn in self._closers:
            result = guarded(fn, self.timeout_s, self._lock)
            if not result.ok:
                self.errors.append(f"close: {result.why(self.timeout_s)}")
        if self._host is not None:
            self._host.close()  # the environment's close() runs in its process; the process is reused


def _outcome(result: Result, tool: Tool, name: str, timeout: float, *, interpret: bool = True) -> ToolOutcome:
    """A call's :class:`ToolOutcome`: its text (a hosted call's value already is), or its failure in the
    tool's words."""
    if result.ok and not interpret:
        return ToolOutcome(result.value, "ok")
    if result.ok:
        try:
            text, reward = tool.interpret(result.value)
        except Exception as exc:  # noqa: BLE001 (a verl tool returning an unexpected shape)
            return ToolOutcome(f"Error: {name} returned an unusable result: {one_line(exc)}", "error")
        return ToolOutcome(text, "ok", reward)
    if result.status == "timeout":
        message = f"{name} {result.why(timeout)} and was stopped"
        return ToolOutcome(error_content(tool.style, name, "", message), "timeout")
    if result.status == "busy":
        return ToolOutcome(f"Error: {name} {result.why(timeout)}", "error")
    return ToolOutcome(error_content(tool.style, name, result.error_type, result.message), "error")
