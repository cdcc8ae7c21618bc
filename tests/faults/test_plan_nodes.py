"""``--gpus 32`` without ``--nodes`` (issue 24): no H100 server holds 32 GPUs, so the plan takes the GPU
type's usual node size (8) and says so; the torchrun and SLURM commands follow it."""

from __future__ import annotations

import json

from tests.support.cli import rlctl_in_process

BASE = ("grpo", "--model", "Qwen2.5-72B", "--gpu", "H100-80GB", "--dry-run")


def _dry_run(monkeypatch, capsys, *args: str) -> dict:
    code, text = rlctl_in_process(monkeypatch, capsys, *BASE, *args, "--json")
    assert code == 0, text
    return json.loads(text)


def test_32_gpus_are_4_nodes_of_8_with_the_reason(monkeypatch, capsys):
    doc = _dry_run(monkeypatch, capsys, "--gpus", "32")
    plan = doc["plan"]
    assert (plan["nodes"], plan["nproc_per_node"], plan["gpus"]) == (4, 8, 32), plan
    assert doc["config"]["hardware"]["nodes"] == 4
    assert any("nodes 4" in r and "(8)" in r for r in plan["reasons"]), plan["reasons"]
    launch = doc["launch"]
    assert launch[launch.index("--nnodes") + 1] == "4" and launch[launch.index("--nproc-per-node") + 1] == "8"


def test_the_slurm_script_asks_for_4_nodes_of_8(monkeypatch, capsys):
    doc = _dry_run(monkeypatch, capsys, "--gpus", "32", "--launcher", "slurm")
    assert "#SBATCH --nodes=4" in doc["sbatch"] and "#SBATCH --gpus-per-node=8" in doc["sbatch"], doc["sbatch"]


def test_nodes_given_or_one_server_are_kept(monkeypatch, capsys):
    assert _dry_run(monkeypatch, capsys, "--gpus", "32", "--nodes", "2")["plan"]["nodes"] == 2
    assert _dry_run(monkeypatch, capsys, "--gpus", "8")["plan"]["nodes"] == 1
