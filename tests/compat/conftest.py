"""Peer files (verl's and TRL's shapes, written here by rlctl) run through the CLI: the tiny models of the
agent tests (one trained to call its ``add`` tool) and helpers for the runs."""

from __future__ import annotations

import json
from pathlib import Path

from tests.agents.conftest import agent_model_dir  # noqa: F401 (the fixture, shared)
from tests.support.cli import run_cli
from tests.support.rl import failure, train_records
from tests.support.sft import write_jsonl

__all__ = ["agent_run", "samples", "write"]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def samples(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]


def agent_run(model_dir: Path, tmp: Path, rows: list[dict], *extra: str, ok: bool = True):
    """One GRPO step of the tool-calling tiny model on ``rows`` (each prompt 4 samples): (result, records, run)."""
    run = tmp / "run"
    data = write_jsonl(tmp / "data.jsonl", rows)
    args = [
        "--model", str(model_dir), "--data", str(data), "--output-dir", str(run), "--device", "cpu",
        "--nproc", "1", "--batch-size", "2", "--n", "4", "--max-prompt-len", "200", "--max-response-len", "96",
        "--lr", "1e-4", "--rollout", "hf", "--max-steps", "1", "--max-turns", "3", "--samples-every", "1",
        "--set", "log.samples=8", "--set", "checkpoint.export_hf=false", *extra,
    ]  # fmt: skip
    res = run_cli("grpo", *args)
    if ok:
        assert res.returncode == 0, failure(res, run)
        return res, train_records(run), run
    return res, [], run
