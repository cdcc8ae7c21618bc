"""The example's reward (verl's signature): 1.0 when the final assistant message is exactly the answer.

With tools, ``extra_info["messages"]`` holds the whole conversation: the score reads the last assistant
turn only, so a trajectory that calls the calculator and stops (the result is in the tool message, not in
an answer) scores 0. Without tools the response is the answer itself.
"""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    messages = (extra_info or {}).get("messages") or []
    assistant = [m for m in messages if m.get("role") == "assistant"]
    final = (assistant[-1].get("content") or "") if assistant else solution_str
    if assistant and assistant[-1].get("tool_calls"):
        return 0.0  # ended on a call (turn limit): no answer given
    return float(final.strip() == str(ground_truth).strip())
