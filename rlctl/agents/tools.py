"""The agents' public names in one place, for callers that want the whole API: loading (:mod:`.spec`), the
call and its outcome (:mod:`.calls`), one trajectory's :class:`~rlctl.agents.episode.Episode`, and running a
batch's calls (:mod:`.runner`). Each lives in its own module; this one only gathers them."""

from __future__ import annotations

from rlctl.agents.calls import ToolCall, ToolOutcome
from rlctl.agents.episode import Episode
from rlctl.agents.runner import cap_text, outcome_counts, run_calls
from rlctl.agents.spec import AgentSpec, load_agent_spec

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
