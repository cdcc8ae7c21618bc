"""benchmarks/megatron_gpu_check.py, the parts that run before any GPU work, checked on CPU.

On the lent GPU machine gpu_check.sh installs megatron-core, omegaconf and datasets into a private folder
on PYTHONPATH; the script's child processes (its torchrun ranks, the ``rlctl`` CLI runs) must keep that
folder. Its CLI jobs must build (their data helpers import) and plan on CUDA (``--dry-run``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "megatron_gpu_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("megatron_gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_child_processes_keep_the_kit_folder_on_pythonpath(tmp_path, monkeypatch):
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "kit_only_module.py").write_text("NAME = 'from the kit'\n")
    monkeypatch.setenv("PYTHONPATH", str(kit))
    code = "import kit_only_module, rlctl; print(kit_only_module.NAME); print(rlctl.__file__)"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=_script().child_env(), cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    name, rlctl_file = proc.stdout.split("\n")[:2]
    assert name == "from the kit"
    assert Path(rlctl_file).resolve().is_relative_to(REPO)  # this checkout's rlctl comes first


def test_cli_jobs_build_and_plan_on_cuda(tmp_path):
    from rlctl.testing import build_tiny_model

    hf = build_tiny_model(tmp_path / "hf", num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    jobs = _script().cli_jobs(hf, tmp_path / "cli", gpus=1)
    assert sorted(jobs) == ["grpo", "sft"] and all(sorted(j) == ["fsdp", "megatron"] for j in jobs.values())
    for method, argvs in jobs.items():
        assert "parallel.backend=megatron" in argvs["megatron"] and "parallel.tp=1" in argvs["megatron"]
        assert "parallel.backend=megatron" not in argvs["fsdp"]
        for backend, argv in argvs.items():
            proc = subprocess.run(
                [sys.executable, "-m", "rlctl", *argv, "--dry-run"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=300,
                env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
            )
            assert proc.returncode == 0, (method, backend, proc.stdout[-2000:] + proc.stderr[-2000:])
