"""Reward functions for the RL tests (verl's signature)."""


def digits(data_source, solution_str, ground_truth, extra_info=None):
    """The share of the response's characters that are digits: a tiny random model can learn it in a
    few steps. The row whose answer is "boom" always fails (to test per-sample errors)."""
    if str(ground_truth) == "boom":
        raise ValueError("boom: this row's grader fails")
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))


def always_fails(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("the grading service is down\n(second line of the message)")
