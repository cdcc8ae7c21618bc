"""benchmarks/gpu_check.sh --dry: the GPU check's own commands, checked on CPU (no GPU in CI; the real path
under a fake CUDA python is in test_gpu_kit.py).

Every train step's exact --set options go through ``rlctl <method> --dry-run --json`` on a CUDA plan, and
the resolved config must carry each value; the other commands' options must exist. A step with a misspelt
key fails the dry run (checked on a copy of the script), so the real run on a GPU cannot die on its
command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _run(script: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "GPU_CHECK_REPO": str(REPO),
    }
    return subprocess.run(
        ["bash", str(script), "--dry", "--out", str(out), *args], capture_output=True, text=True, env=env, timeout=900
    )


@pytest.mark.slow
def test_gpu_check_dry_mode_checks_every_command(tmp_path):
    proc = _run(SCRIPT, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [s["step"] for s in doc["steps"]]
    for expected in ("grpo-fsdp-hf", "sft-offload", "grpo-tools-hf", "vl-sft-grpo", "sft-pure-bf16-savers",
                     "sft-lora", "sft-megatron", "grpo-vllm", "grpo-sglang", "ppo-vllm", "grpo-vllm-pressure",
                     "bench-rollout", "megatron-gpu-check", "megatron-cli", "dpo", "rm", "grpo-distill",
                     "grpo-distill-full", "eval-hf"):  # fmt: skip
        assert expected in names
    assert {s["status"] for s in doc["steps"]} == {"dry-ok"}
    assert "nothing ran on a GPU" in doc["what"]
    plan = next(s for s in doc["steps"] if s["step"] == "sft-offload")["result"]["plan"]
    assert plan["device"] == "cuda" and plan["offload_params"] and plan["estimate"]["phases"]
    # one GPU, yet FSDP2 runs: the step asks for sharding and the plan keeps it
    grpo = next(s for s in doc["steps"] if s["step"] == "grpo-fsdp-hf")["result"]
    assert grpo["config"]["parallel"]["shard"] is True and grpo["config"]["algo"]["kl_coef"] > 0
    # distillation: --teacher reaches the plan as algo.teacher, and the estimate counts the teacher's weights
    for name, signal in (("grpo-distill", "sampled"), ("grpo-distill-full", "full")):
        res = next(s for s in doc["steps"] if s["step"] == name)["result"]
        assert res["config"]["algo"]["teacher"] and res["config"]["algo"]["distill"] == signal
        assert res["plan"]["estimate"]["phases"]["training"]["components"]["teacher_model"] > 0
    for name in ("dpo", "rm"):
        assert next(s for s in doc["steps"] if s["step"] == name)["result"]["config"]["method"] == name


def test_gpu_check_dry_mode_fails_on_a_misspelt_option(tmp_path):
    broken = tmp_path / "gpu_check.sh"
    broken.write_text(SCRIPT.read_text().replace("lora.rank=16", "lora.rnak=16").replace("--prompts 8", "--promts 8"))
    proc = _run(broken, tmp_path, "--only", "sft-lora,bench-rollout")
    assert proc.returncode == 1
    steps = {s["step"]: s for s in json.loads((tmp_path / "gpu_check.json").read_text())["steps"]}
    assert steps["sft-lora"]["status"] == steps["bench-rollout"]["status"] == "dry-failed"
    assert any("rnak" in line for line in steps["sft-lora"]["output_tail"])


def test_only_runs_its_steps_in_its_own_order_and_refuses_an_unknown_name(tmp_path):
    proc = _run(SCRIPT, tmp_path, "--only", "megatron-cli,eval-hf,dpo")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert [s["step"] for s in steps] == ["megatron-cli", "eval-hf", "dpo"]  # not the table's order
    assert {s["status"] for s in steps} == {"dry-ok"}
    proc = _run(SCRIPT, tmp_path, "--only", "dpo,eval-fh")
    assert proc.returncode == 2 and "no step eval-fh in --only" in proc.stderr and "eval-hf" in proc.stderr


@pytest.mark.slow
def test_eval_step_runs_rlctl_eval_and_the_table_renders_it(tmp_path):
    """benchmarks/eval_gpu_check.py (the eval-hf step) on CPU with the tiny model: a real `rlctl eval` child, its
    tokens/s from its own samples and time, its RSS sampled; then gpu_check_table.py renders the row."""
    out = tmp_path / "eval"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "eval_gpu_check.py"), "--model", "tiny", "--device", "cpu"]
        + ["--prompts", "4", "--n", "2", "--max-new-tokens", "8", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    (r,) = doc["results"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 2 and r["eval"]["samples"] == 8
    tokens = sum(s["response_tokens"] for s in samples)
    assert r["tokens_per_step"] == tokens and r["tokens_per_s"] == pytest.approx(tokens / r["time_s"]["step"])
    assert 0 < r["time_s"]["step"] < r["time_s"]["command"]  # sampling is part of the whole command
    assert r["memory"]["measured_bytes"] > 100 * 2**20 and r["memory"]["samples"] > 0
    run = tmp_path / "gpu_check.json"
    run.write_text(json.dumps({"steps": [{"step": "eval-hf", "status": "ok", "seconds": 9.0, "result": doc}]}))
    table = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check_table.py"), str(run)], capture_output=True, text=True
    )
    row = table.stdout.splitlines()[-1]
    assert row.startswith("| eval-hf | ok | 9 |") and f"| {r['tokens_per_s']:.0f} |" in row
    assert f"| {r['memory']['measured_bytes'] / 1e9:.2f} / - |" in row  # no estimate beside it


def test_the_table_shows_when_the_peak_happened_and_the_memory_around_the_final_save(tmp_path):
    """A step's G5 figures (as rlctl bench train records them on CUDA) reach their columns."""
    memory = {
        "measured_bytes": 26.5e9, "estimated_bytes": 13.8e9, "relative_error": 0.48,
        "torch_allocated_peak_bytes": 11.9e9, "estimated_allocated_bytes": 12e9,
        "torch_reserved_peak_bytes": 12.3e9, "estimated_reserved_bytes": 12.8e9,
        "peak_after_last_step_s": 2.5, "processes_at_peak": [{"pid": 1}, {"pid": 2}],
        "outside_torch_at_steps_bytes": 3e9,
        "around_final_save": {"after_final_save": {"reserved_peak_bytes": 20e9, "device_used_bytes": 26e9}},
    }  # fmt: skip
    result = {"results": [{"time_s": {"step": 0.17}, "tokens_per_s": 6000.0, "mfu": 0.001, "memory": memory}]}
    run = tmp_path / "gpu_check.json"
    run.write_text(json.dumps({"steps": [{"step": "sft-megatron", "status": "ok", "seconds": 91.6, "result": result}]}))
    out = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check_table.py"), str(run)], capture_output=True, text=True
    ).stdout.splitlines()
    header, row = out[0], out[-1]
    assert len(header.split("|")) == len(row.split("|"))
    assert row == (
        "| sft-megatron | ok | 92 | 0.17 | 6000 | 0.10% | 26.50 / 13.80 (+48%) | 11.90 / 12.00 | 12.30 / 12.80 "
        "| +2.5 | 2 | 3.00 | 20.00 / 26.00 |"
    )
