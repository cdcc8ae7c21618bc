"""What ``--tools`` / ``--env`` / ``--interaction`` name, loaded once per process (torch-free):
:func:`load_agent_spec` builds an :class:`AgentSpec`, whose :meth:`~AgentSpec.open` starts one trajectory's
:class:`~rlctl.agents.episode.Episode` (an environment instance, verl tool instance ids, an interaction).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlctl.agents import build
from rlctl.agents.episode import Episode
from rlctl.agents.sources import EnvClass, Functions, Interactions
from rlctl.agents.sync_host import warm
from rlctl.errors import UserError

__all__ = ["AgentSpec", "load_agent_spec"]


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
