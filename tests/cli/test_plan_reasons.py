"""The plan's "why" lines agree with each other and with the verdict (issue 37, item 8): the CLI's JSON in
process, each claim checked against the estimate's own numbers."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

GIB = 2**30


def cli(*args: str) -> dict:
    from rlctl.cli.app import app

    r = CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def reasons(plan: dict) -> list[str]:
    return [d["why"] for d in plan["decisions"]]


def test_long_responses_one_limit_wording_and_no_reject_for_the_winners_own_shortfall():
    est = cli("estimate", "memory", "--model", "Qwen2.5-7B", "--max-response-len", "32768", "--json")
    why = reasons(est["plan"])
    gpu = est["gpu_memory_bytes"] / GIB
    # every limit quoted says what it is: the GPU less the margin (5%) or less the comfort share (10%)
    for line in why:
        for value in re.findall(r"limit \((\d+\.\d) GiB, the GPU's (\d+\.\d) GiB less (\d+)%\)", line):
            assert abs(float(value[0]) - gpu * (1 - int(value[2]) / 100)) < 0.06 and value[1] == f"{gpu:.1f}", line
        assert "(the limit:" not in line and "comfortable: <=" not in line, line
    # one sequence (33280 tokens) is over the 16384-token target: no claim that the micro batch is within it
    micro = next(line for line in why if line.startswith("micro batch"))
    assert "<= 16384 tokens" not in micro and "33280 tokens" in micro, micro
    # the plan's own KV cache is short of 32: no option is "rejected" for that same shortfall
    assert est["kv_cache_sequences"] < 32
    assert not [line for line in why if line.startswith("rejected") and "KV cache" in line], why
    assert any(line.startswith("no option is a good fit: fsdp") for line in why), why


def test_checkpointing_off_says_how_much_stays_free():
    doc = cli("sft", "--model", "Llama-3.1-70B", "--gpus", "128", "--dry-run", "--json")
    line = next(w for w in reasons(doc["plan"]) if w.startswith("activation checkpointing off"))
    free = (doc["estimate"]["gpu_memory_bytes"] - doc["estimate"]["phases"]["training"]["total_bytes"]) / GIB
    assert f"{free:.1f} GiB of the GPU stay free" in line, line
    assert "comfortable limit (71.3 GiB, the GPU's 79.2 GiB less 10%)" in line, line
