"""`rlctl bench rollout`'s table at 80 columns: the main column (tokens/s) and every header whole."""

from __future__ import annotations

from rich.console import Console

from rlctl.bench.tables import render_rollout

DOC = {
    "settings": {"prompts": 8, "n": 4, "prompt_len": 64, "max_tokens": 64, "device": "cpu", "dtype": "fp32", "reps": 3},
    "results": [
        {
            "engine": engine,
            "load_s": 12.3,
            "tokens_per_s": 12345.6,
            "tokens_per_s_distinct": 9876.5,
            "shared_prefix_speedup": 1.25,
            "ttft_s": 0.1234,
            "decode_tokens_per_s": 23456.7,
            "peak_memory_bytes": 3.2 * 2**30,
            "memory": {"source": "peak RSS"},
        }
        for engine in ("hf", "vllm")
    ],
}


def test_rollout_table_is_whole_at_80_columns():
    console = Console(width=80, record=True, color_system=None)
    render_rollout(console, DOC)
    text = console.export_text()
    rows = [line for line in text.splitlines() if line.startswith(("│ hf", "│ vllm"))]
    assert len(rows) == 2 and all(len(line) <= 80 for line in text.splitlines())
    for line in rows:  # every cell whole, on one line
        for cell in ("12,345.6", "9,876", "1.25x", "12.3", "123.4", "23,457", "3.20 GiB"):
            assert cell in line, (cell, line)
    assert "…" not in text and "tokens/s" in text
