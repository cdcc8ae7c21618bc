"""The reward of benchmarks/grpo_vs_trl.py: the share of digits and spaces in a response, a signal that a
model with random weights can climb (its responses are random tokens of the tokenizer's vocabulary)."""


def digits(data_source, solution_str, ground_truth, extra_info=None) -> float:
    text = solution_str or ""
    return sum(c.isdigit() or c == " " for c in text) / max(1, len(text))
