"""The GPU kit and the GPU check's real path, on CPU.

* ``benchmarks/gpu_kit.py`` (``make gpu-kit``) builds the wheels the lent GPU machine's image lacks, under
  its size limit; installed the way benchmarks/gpu_check.sh installs them there (``pip install --no-index
  --no-deps --target``, for CPython 3.12), they are enough: in a fresh venv that holds only the image's
  distributions (those of benchmarks/gpu_image_packages.txt installed here, linked in), ``python -m rlctl sft``,
  ``grpo``, ``dpo``, ``rm`` and on-policy distillation (``grpo --teacher``, ``algo.distill=full``) train a tiny
  model end to end, every torchrun rank included, and ``rlctl eval`` scores it (the gpu_check.sh steps' commands
  on CPU). A module any process imports that is neither in the image nor in the kit fails the run.
* ``benchmarks/gpu_check.sh`` without ``--dry``, with a stand-in python that tells the script's CUDA probe
  yes (a fake at the one boundary CPU cannot cross: labelled) and no ``rlctl`` on PATH, under ``--budget 60``:
  the kit is installed, every step is run or skipped with its reason, and one JSON lands in ``$OUT``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_kit  # noqa: E402

from tests.support.pref import format_pairs  # noqa: E402
from tests.support.sft import write_jsonl  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-kit") / ".gpu-kit"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_kit.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "MiB (limit" in proc.stdout  # the size is printed
    return out


def test_the_kit_holds_what_the_image_lacks_and_fits(kit):
    doc = json.loads((kit / "kit.json").read_text())
    dists = doc["distributions"]
    image = gpu_kit.image_packages()
    # rlctl's own requirements the image lacks, by name (what issue 35 found missing on the machine)
    for name in ("datasets", "dill", "multiprocess", "omegaconf", "math-verify", "megatron-core"):
        assert name in dists and name not in image
    assert not set(dists) & image  # nothing the image already has (a second version would shadow it)
    for name, info in dists.items():
        assert info["version"] == metadata.version(name)  # the version CI tests
        assert (kit / info["wheel"]).is_file()
    size = sum(p.stat().st_size for p in kit.iterdir())
    assert size < 48 * 2**20


def _with_requirements(names: set[str]) -> set[str]:
    """``names`` and everything they require, as installed here (the image is consistent: a distribution it
    holds has its own requirements, at whatever version it was built with)."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [gpu_kit.norm(r.name) for r in gpu_kit.requirements(name)]
        except metadata.PackageNotFoundError:
            pass
    return seen


def _image_venv(root: Path) -> Path:
    """A fresh venv whose site-packages holds only the image's distributions (and what they require) that
    are installed here, linked in."""
    venv.EnvBuilder(with_pip=False).create(root)
    site = next((root / "lib").glob("python3*/site-packages"))
    linked = set()
    for name in sorted(_with_requirements(gpu_kit.image_packages())):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        base = Path(dist.locate_file(""))
        for f in dist.files or []:
            top = f.parts[0]
            if top in linked or top in ("..", "__pycache__") or top.endswith(".data"):
                continue
            linked.add(top)
            if (base / top).exists() and not (site / top).exists():
                (site / top).symlink_to(base / top)
    return root / "bin" / "python"


def test_the_image_plus_the_kit_runs_every_method_and_eval(kit, tmp_path, tiny_model_dir):
    sft_data = write_jsonl(
        tmp_path / "sft.jsonl",
        [{"messages": [{"role": "user", "content": f"{i} + 1?"}, {"role": "assistant", "content": f"{i + 1}"}]}
         for i in range(8)],
    )  # fmt: skip
    rl_data = write_jsonl(tmp_path / "rl.jsonl", [{"prompt": f"{i} + 1?", "answer": str(i + 1)} for i in range(8)])
    pairs = write_jsonl(tmp_path / "pairs.jsonl", format_pairs(8))
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target"]
    cp312 = ["--python-version", "3.12", "--only-binary=:all:"] + [
        arg for p in gpu_kit.PLATFORMS + ["any"] for arg in ("--platform", p)
    ]  # the GPU machine's Python; this one only checks that the wheels install together (one version each)
    proc = subprocess.run([*pip, str(target), *cp312, *map(str, kit.glob("*.whl"))], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # the runs below import the kit's distributions from the files pip --target wrote (pure Python, as
    # every one the ranks need is); megatron-core's compiled parts are for 3.12 and not imported by them
    python = _image_venv(tmp_path / "image")
    assert subprocess.run([python, "-c", "import datasets"], capture_output=True).returncode != 0  # not in the image
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHONPATH=f"{target}:{REPO}", OMP_NUM_THREADS="1", PATH=f"{python.parent}:/usr/bin:/bin")
    common = ["--model", str(tiny_model_dir), "--device", "cpu", "--nproc", "1", "--max-steps", "1"]
    grpo = ["grpo", "--data", str(rl_data), "--reward", "exact", "--batch-size", "2", "--n", "2"]
    grpo += ["--max-prompt-len", "64", "--max-response-len", "8", "--rollout", "hf"]
    runs = {
        "sft": ["sft", "--data", str(sft_data), "--batch-size", "4", "--max-len", "64"],
        "grpo": grpo,
        "dpo": ["dpo", "--data", str(pairs), "--batch-size", "2", "--max-len", "64"],
        "rm": ["rm", "--data", str(pairs), "--batch-size", "2", "--max-len", "64"],
        "distill": [*grpo, "--teacher", str(tiny_model_dir), "--set", "algo.distill=full"],
    }
    for name, args in runs.items():
        out = tmp_path / name
        proc = subprocess.run(
            [python, "-m", "rlctl", *args, *common, "-o", str(out)],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
        )  # fmt: skip
        log = (out / "train.log").read_text() if (out / "train.log").exists() else ""
        assert proc.returncode == 0, f"{name}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}{log[-3000:]}"
        assert (out / "hf" / "config.json").is_file()
    proc = subprocess.run(
        [python, "-m", "rlctl", "eval", str(tmp_path / "sft"), "--data", str(rl_data), "--reward", "exact"]
        + ["--device", "cpu", "--max-new-tokens", "8", "--json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["prompts"] == 8 and summary["response_tokens"] > 0


FAKE_PYTHON = """#!/usr/bin/env bash
# A stand-in python (a test fake, labelled): it tells gpu_check.sh's CUDA probe that a GPU is visible and
# hands everything else to the real interpreter, where no GPU is visible, so each step fails fast.
case "$*" in *torch.cuda.is_available*) exit 0 ;; esac
exec {python} "$@"
"""


def test_the_real_path_under_a_budget_writes_one_json_naming_every_step(kit, tmp_path):
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "python3").write_text(FAKE_PYTHON.format(python=sys.executable))
    (fakebin / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHON")}
    env.update(PATH=f"{fakebin}:/usr/bin:/bin", OUT=str(out), OMP_NUM_THREADS="1")
    # another job's ranks on the same machine (here: a process named like one): the check's clean-up after
    # each step must leave them alone (it once killed every torch.distributed.run / rlctl.recipes process)
    other = subprocess.Popen(
        ["bash", "-c", "exec -a 'python -m torch.distributed.run -m rlctl.recipes.grpo --run-dir /elsewhere' sleep 300"]
    )
    try:
        proc = subprocess.run(
            ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--budget", "60", "--kit", str(kit)],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
        assert other.poll() is None, "the check killed another job's process"
    finally:
        other.kill()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # no step can pass without a GPU
    assert "[kit ] installing" in proc.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == ["gpu_check.json", "gpu_check.log"]
    doc = json.loads((out / "gpu_check.json").read_text())
    assert doc["budget_s"] == 60 and doc["versions"]["torch"]
    names = [s["step"] for s in doc["steps"]]
    assert names[:6] == ["grpo-fsdp-hf", "sft-offload", "grpo-tools-hf", "vl-sft-grpo", "sft-pure-bf16-savers",
                         "sft-lora"]  # fmt: skip
    assert len(names) == len(set(names)) == 22
    statuses = {s["step"]: s for s in doc["steps"]}
    ran = [s for s in doc["steps"] if s["status"] in ("failed", "timeout")]
    assert ran and all("output_tail" in s for s in ran)
    assert any("no GPU is visible" in line for line in statuses["grpo-fsdp-hf"]["output_tail"])
    assert any(s["status"] == "skipped" and s["reason"].startswith("budget") for s in doc["steps"])
    assert statuses["grpo-sglang"]["reason"] == "not installed: sglang"
    assert all(s["status"] in ("failed", "timeout", "skipped") for s in doc["steps"])
