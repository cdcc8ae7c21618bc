"""Running a batch's tool calls: different trajectories in parallel, one trajectory's calls in order, each
with a timeout and an output cap; a failure is an outcome, never an exception."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from rlctl.agents.calls import ToolCall, ToolOutcome
from rlctl.errors import one_line

if TYPE_CHECKING:
    from rlctl.agents.episode import Episode

__all__ = ["cap_text", "outcome_counts", "run_calls"]


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
