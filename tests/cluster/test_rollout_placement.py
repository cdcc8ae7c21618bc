"""Rollout engines per node: vLLM/SGLang tensor parallel inside a node, never across.

An engine's ranks are ``rollout.tp`` consecutive global ranks; torchrun gives a node's processes
consecutive ranks, so the engine stays inside a node exactly when ``rollout.tp`` divides the processes
per node (hand-checked below: node k holds ranks k*P .. k*P+P-1).
"""

from __future__ import annotations

import pytest

from rlctl.errors import UserError
from rlctl.runtime.dist import check_rollout_in_node
from tests.support.cli import run_cli


def _inside_a_node(tp: int, per_node: int, nodes: int) -> bool:
    """Every engine group (tp consecutive ranks) on one node, by listing the groups."""
    world = per_node * nodes
    groups = [range(g, g + tp) for g in range(0, world, tp)]
    return all(len({r // per_node for r in grp}) == 1 for grp in groups)


@pytest.mark.parametrize("tp, per_node", [(1, 8), (2, 8), (4, 8), (8, 8), (16, 8), (3, 8), (8, 4), (2, 6), (4, 6)])
def test_refused_exactly_when_an_engine_would_span_nodes(tp, per_node):
    if _inside_a_node(tp, per_node, nodes=6):
        check_rollout_in_node(tp, per_node)
    else:
        with pytest.raises(UserError, match=f"rollout.tp={tp} would split a rollout engine across nodes"):
            check_rollout_in_node(tp, per_node)


def test_a_plan_with_tp_across_nodes_is_refused_before_launch(tmp_path):
    data = tmp_path / "rl.jsonl"
    data.write_text('{"prompt": "What is 1 + 2?", "answer": "3"}\n')
    r = run_cli(
        "grpo",
        "--model",
        "Qwen2.5-72B",
        "--data",
        str(data),
        "--gpus",
        "32",
        "--nodes",
        "8",
        "--gpu",
        "H100-80GB",
        "--rollout",
        "vllm",
        "--set",
        "rollout.tp=8",
        "--dry-run",
    )
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: rollout.tp=8 would split a rollout engine across nodes (4 processes per node)")
