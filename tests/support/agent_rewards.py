"""Reward functions of the agent tests (verl's signature)."""


def answered(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last assistant message states the ground truth. Reads the conversation from ``extra_info``
    (what an agent run adds): a run that did not pass it fails here, loudly."""
    messages = extra_info["messages"]
    last = [m for m in messages if m["role"] == "assistant"][-1]
    return float(str(ground_truth) in (last.get("content") or "")) + 0.1 * len(extra_info["tool_calls"])
