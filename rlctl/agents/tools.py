"""Tools, environments and interactions for multi-turn rollouts: loading them (torch-free) and running
calls (in parallel, each with a timeout and an output cap; a failure is an outcome, never an exception).

``load_agent_spec(tools=, env=, interaction=)`` reads what ``--tools`` / ``--env`` / ``--interaction``
name once per process; ``spec.open(row)`` starts one trajectory's :class:`Episode` (an environment
instance, verl tool instance ids, an interaction); :func:`run_calls` runs the calls of a whole batch.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rlctl.agents.guard import guarded
from rlctl.agents.sources import Interactions, Tool, error_content
from rlctl.agents.sync_host import EpisodeHost
from rlctl.errors import UserError, did_you_mean, one_line

__all__ = [
    "AgentSpec",
    "Episode",
    "ToolCall",
    "ToolOutcome",
    "cap_text",
    "load_agent_spec",
    "outcome_counts",
    "run_calls",
]

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


class Episode:
    """One trajectory's tools and state. Every method runs the user's code with the episode's timeout and
    never raises; failures outside tool calls (a reward, a user turn, close) are listed in ``errors``."""

    def __init__(self, schemas: list[dict], timeout_s: float, results: str | None = None):
        self.schemas = schemas
        self.results = results  # agent.tool_results: None = each source its peer's (TRL's, verl's)
        self.prompt_suffix: str | None = None
        self.timeout_s = float(timeout_s)
        self.turn_scores: list[float] = []  # verl interaction: each user turn's score
        self.messages: list[dict] = []  # the conversation so far (the loop's; verl's agent_data.messages)
        self.errors: list[str] = []
        self._tools: dict[str, Tool] = {}
        self._rewards: list[tuple[str, Any]] = []
        self._closers: list[Any] = []
        self._interaction: Any = None
        self._lock = threading.Lock()  # an environment's methods never run concurrently
        self._closed = False
        self._host: EpisodeHost | None = None

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
            status, value = tool.hosted(call.arguments, timeout)
        else:
            status, value = guarded(lambda: tool.run(call.arguments), timeout, self._lock)
        if status == "ok":
            if tool.hosted is not None:
                return ToolOutcome(value, "ok")
            try:
                text, reward = tool.interpret(value)
            except Exception as exc:  # noqa: BLE001 (a verl tool returning an unexpected shape)
                return ToolOutcome(f"Error: {name} returned an unusable result: {one_line(exc)}", "error")
            return ToolOutcome(text, "ok", reward)
        if status == "timeout":
            message = f"{name} took longer than {timeout:g} s and was stopped"
            return ToolOutcome(error_content(tool.style, name, "", message), "timeout")
        if status == "busy":
            return ToolOutcome(f"Error: {name} was not run: an earlier call is still running", "error")
        kind, message = value if isinstance(value, tuple) else ("", value)  # guard's text is "Type: message"
        if not kind and tool.style != "rlctl":
            kind, _, message = message.partition(": ")
        return ToolOutcome(error_content(tool.style, name, kind, message), "error")

    def user_turn(self, messages: list[dict]) -> tuple[bool, str | None]:
        """verl Interaction: ``(done, reply)`` after an assistant turn; ``(False, None)`` without one.
        A failing interaction ends the episode: ``(True, None)``."""
        if self._interaction is None:
            return False, None
        status, value = guarded(lambda: self._interaction(messages), self.timeout_s, self._lock)
        try:
            if status != "ok":
                raise RuntimeError(value if status == "error" else f"took longer than {self.timeout_s:g} s")
            done, reply, score = value[0], value[1], value[2]
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
            status, value = fn() if hosted else guarded(fn, self.timeout_s, self._lock)
            try:
                if status != "ok":
                    why = ": ".join(value) if isinstance(value, tuple) else value
                    raise RuntimeError(why if status == "error" else f"took longer than {self.timeout_s:g} s")
                out[name] = float(value)
            except Exception as exc:  # noqa: BLE001
                self.errors.append(f"reward {name}: {one_line(exc)}")
                out[name] = 0.0
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fn in self._closers:
            status, value = guarded(fn, self.timeout_s, self._lock)
            if status != "ok":
                self.errors.append(f"close: {value if status == 'error' else status}")
        if self._host is not None:
            self._host.close()  # the environment's close() runs in its process; the process is reused


class AgentSpec:
    """What ``--tools`` / ``--env`` / ``--interaction`` name, loaded once; :meth:`open` per trajectory."""

    def __init__(self, sources: list[Any], timeout_s: float = 30.0, results: str | None = None):
        """``results``: agent.tool_results (None: each source's peer's)."""
        self.sources, self.results = sources, results
        self.schemas: list[dict] = [s for src in sources for s in src.schemas]
        self.timeout_s = float(timeout_s)
        names = [n for src in sources for n in src.names]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise UserError(f"tool name {', '.join(dup)} is defined twice; tool names must be unique")
        self.tool_names = names
        self.has_interaction = any(isinstance(s, Interactions) for s in sources)

    def open(self, row: dict) -> Episode:
        """One trajectory. Raises :class:`UserError` when an environment's reset (or a verl create) fails."""
        episode = Episode(self.schemas, self.timeout_s, self.results)
        for source in self.sources:
            source.attach(episode, row)
        return episode

    def prepare(self, trajectories: int) -> None:
        """Before a batch's :meth:`open` calls: the worker processes of its sync tools, started together."""
        from rlctl.agents.sources import EnvClass, Functions
        from rlctl.agents.sync_host import warm

        if any(isinstance(s, (EnvClass, Functions)) for s in self.sources):
            warm(trajectories)

    def reward_names(self) -> set[str]:
        """The environment rewards its sources produce: ``env`` (get_reward), ``tool`` (verl tools' step
        rewards and calc_reward), ``interaction`` (verl turn scores)."""
        return {name for s in self.sources for name in getattr(s, "reward_names", ())}

    def describe(self) -> str:
        return "; ".join(s.describe() for s in self.sources)


def load_agent_spec(
    tools: str = "",
    env: str = "",
    interaction: str = "",
    *,
    timeout_s: float = 30.0,
    results: str | None = None,
    verl_lifecycle: str = "call",
) -> AgentSpec | None:
    """Load the tools (``FILE.py``, ``FILE.py:a,b`` or verl's tool YAML; several joined by ``;``), the
    environment class (``FILE.py:Class``) and the interaction (verl's YAML or ``FILE.py:Class``).
    None when all three are empty. Torch-free; bad input is a one-line :class:`UserError`. ``results``
    (agent.tool_results): whose text tool results and errors take; None: each source its peer's.
    ``verl_lifecycle`` (agent.verl_tool_lifecycle): a verl tool's instance per call (verl's agent loop) or
    per trajectory (:class:`rlctl.agents.sources.VerlTools`)."""
    from rlctl.agents import build

    sources: list[Any] = []
    for spec in (s.strip() for s in (tools or "").split(";") if s.strip()):
        if Path(spec).suffix.lower() in (".yaml", ".yml"):
            sources.append(build.verl_tools(spec, verl_lifecycle))
        else:
            sources.append(build.functions(spec))
    if env and env.strip():
        sources.append(build.env_class(env.strip()))
    if interaction and interaction.strip():
        sources.append(build.interactions(interaction.strip()))
    return AgentSpec(sources, timeout_s, results) if sources else None


def cap_text(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` (0: no cap), saying how much was cut."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... [{len(text) - max_chars} more characters cut]"


def run_calls(pending: list[tuple[Episode, ToolCall]], *, timeout_s: float, max_chars: int) -> list[ToolOutcome]:
    """Run a batch of calls: different episodes in parallel, one episode's calls in order; each call at
    most ``timeout_s`` seconds (0: no limit), its text at most ``max_chars``. Never raises, never hangs:
    a raising, hanging or unknown tool is an outcome (``status``) with error text for the model."""
    groups: dict[int, list[int]] = {}
    for i, (episode, _) in enumerate(pending):
        groups.setdefault(id(episode), []).append(i)
    results: list[ToolOutcome | None] = [None] * len(pending)

    def work(indices: list[int]) -> None:
        for i in indices:
            episode, call = pending[i]
            try:
                out = episode.call(call, timeout_s)
            except Exception as exc:  # noqa: BLE001 (Episode.call does not raise; a subclass might)
                out = ToolOutcome(f"Error: {type(exc).__name__}: {one_line(exc)}", "error")
            results[i] = ToolOutcome(cap_text(out.content, max_chars), out.status, out.reward)

    threads = [threading.Thread(target=work, args=(ix,), daemon=True, name="rlctl-tools") for ix in groups.values()]
    for t in threads[1:]:
        t.start()
    if threads:
        work(next(iter(groups.values())))
    for t in threads[1:]:
        t.join()
    return [r if r is not None else ToolOutcome("Error: the call was not run", "error") for r in results]


def outcome_counts(outcomes: list[ToolOutcome]) -> dict[str, int]:
    """``tool/calls``, ``tool/errors`` (errors and unknown tools) and ``tool/timeouts`` of a batch."""
    return {
        "tool/calls": len(outcomes),
        "tool/errors": sum(o.status in ("error", "unknown_tool") for o in outcomes),
        "tool/timeouts": sum(o.status == "timeout" for o in outcomes),
    }
