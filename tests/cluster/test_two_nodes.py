"""Two nodes simulated on localhost: two `rlctl` commands (``--nodes 2 --nproc 1``), one per node.

Each case is compared with an independent run on ONE node with the same world size (``--nproc 2``):
FSDP2 on gloo with two ranks either way, so the losses and rewards must match step by step. Also: a
directory per node (no shared filesystem) ends in the same one line on both nodes, quickly; the
per-node command of the generated sbatch script, run as two nodes, trains; and a run stopped on two
nodes resumes on one and continues the one-node trajectory exactly.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlctl.runtime.net import free_port
from tests.support.cli import REPO, run_cli
from tests.support.rl import REWARDS, arith_rows, train_records
from tests.support.sft import chat_rows, losses, write_jsonl

pytestmark = pytest.mark.slow

INTERRUPTED = 130


def _start(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        argv, cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def two_nodes(
    per_node: list[list[str]], env: dict | None = None, timeout: int = 300, node_env: list[dict] | None = None
) -> tuple[list, float]:
    """Start the nodes' commands together; their (returncode, stdout, stderr) and the wall time of the slowest."""
    began = time.monotonic()
    procs = [_start(argv, {**(env or {}), **(node_env or [{}, {}])[i]}) for i, argv in enumerate(per_node)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append((p.returncode, stdout, stderr))
    return out, time.monotonic() - began


def rlctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlctl", *args]


def static_nodes(args: list[str], out: list[Path]) -> list[list[str]]:
    """Node 0 and node 1 of a static rendezvous: the same master address and port, node ranks 0 and 1."""
    port = str(free_port())
    common = ["--nodes", "2", "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    return [rlctl(*args, *common, "--node-rank", str(i), "--output-dir", str(out[i])) for i in range(2)]


def last_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("cluster") / "chat.jsonl", chat_rows(48))


def sft_args(model: Path, data: Path) -> list[str]:
    return ["sft", "--model", str(model), "--data", str(data), "--device", "cpu", "--max-steps", "4"] + [
        *("--batch-size", "4", "--max-len", "96", "--lr", "3e-3", "--save-every", "2", "--seed", "3"),
        *("--set", "train.warmup_ratio=0", "--set", "model.dtype=fp32", "--set", "model.attn=sdpa"),
    ]


def test_a_directory_per_node_is_one_line_on_both_nodes(tmp_path, tiny_model_dir, sft_data):
    nodes = static_nodes(sft_args(tiny_model_dir, sft_data), [tmp_path / "node0", tmp_path / "node1"])
    results, wall = two_nodes(nodes, timeout=120)
    for code, _, stderr in results:
        assert code == 2, stderr[-3000:]
        line = last_line(stderr)
        assert line.startswith("error: the run directory must be on a filesystem all nodes share: node 0 ("), line
        assert f"wrote {tmp_path / 'node0'}, node 1 (" in line
        assert "Traceback" not in stderr and "ChildFailedError" not in stderr
    # how long it takes is a measurement (docs/cluster.md), not an assertion: a loaded CI machine varies
    print(f"per-node directories: one-line error on both nodes after {wall:.1f} s")
    assert not (tmp_path / "node1" / "model_meta").exists()  # node 1 stopped before loading anything


def test_sbatch_per_node_command_trains_as_on_one_node_and_resumes_on_one_node(tmp_path, tiny_model_dir, sft_data):
    """The sbatch script's per-node command, run as two nodes (c10d rendezvous on localhost), stopped
    after step 2; resumed on ONE node to step 4. Every loss equals the uninterrupted one-node run's."""
    args = sft_args(tiny_model_dir, sft_data)
    one = tmp_path / "one"
    r = run_cli(*args, "--nproc", "2", "--output-dir", str(one))
    assert r.returncode == 0, r.stderr[-3000:]
    reference = losses(one)
    assert sorted(reference) == [1, 2, 3, 4]

    # the job as SLURM would get it (fake sbatch: the labelled boundary of tests/cluster/test_slurm.py)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 77\n")
    (bin_dir / "sbatch").chmod(0o755)
    two = tmp_path / "two"
    r = run_cli(
        *args,
        "--nodes",
        "2",
        "--nproc",
        "1",
        "--launcher",
        "slurm",
        "--output-dir",
        str(two),
        env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )
    assert r.returncode == 0 and "submitted batch job 77" in r.stdout, r.stderr[-3000:]
    script = (two / "sbatch.sh").read_text()
    command = script.split("--kill-on-bad-exit=1 \\\n", 1)[1].strip()  # the line srun runs on every node
    endpoint = f"127.0.0.1:{free_port()}"
    argv = [a.replace("$HEAD_NODE:$RDZV_PORT", endpoint) for a in re.findall(r'"[^"]*"|\S+', command)]
    argv = [a.strip('"') for a in argv]
    assert argv[:4] == [sys.executable, "-m", "rlctl", "sft"] and "--rdzv-endpoint" in argv
    results, _ = two_nodes([argv, argv], env={"RLCTL_STOP_AFTER_STEP": "2"})
    for code, _, stderr in results:
        assert code == INTERRUPTED, stderr[-3000:]
    assert (two / "checkpoints").is_dir()

    r = run_cli(*args, "--nproc", "2", "--output-dir", str(two), "--resume", "auto")  # now one node
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = losses(two)
    assert sorted(resumed) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5, abs=1e-6), (step, resumed, reference)


def test_grpo_hf_two_slurm_nodes_match_one_node(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "rl.jsonl", arith_rows(32))
    args = [
        "grpo",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data),
        "--device",
        "cpu",
        "--rollout",
        "hf",
        "--batch-size",
        "4",
        "--n",
        "4",
        "--max-prompt-len",
        "48",
        "--max-response-len",
        "8",
        "--lr",
        "1e-2",
        "--max-steps",
        "2",
        "--reward",
        f"{REWARDS}:digits",
        "--seed",
        "5",
    ]
    one = tmp_path / "one"
    r = run_cli(*args, "--nproc", "2", "--output-dir", str(one))
    assert r.returncode == 0, r.stderr[-3000:]
    # two nodes of a SLURM allocation, as `srun --ntasks-per-node=1 rlctl grpo ...` starts them: the SAME
    # command on both; each node's rank and node 0's address come from SLURM's variables (node 0: "localhost")
    shared = tmp_path / "shared"  # the same directory on both nodes (a shared filesystem)
    command = rlctl(*args, "--nproc", "1", "--master-port", str(free_port()), "--output-dir", str(shared))
    slurm = {"SLURM_JOB_ID": "31337", "SLURM_JOB_NODELIST": "localhost,localhost", "SLURM_NNODES": "2"}
    slurm.update(SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="2")
    results, _ = two_nodes([command, command], env=slurm, node_env=[{"SLURM_NODEID": "0"}, {"SLURM_NODEID": "1"}])
    for code, stdout, stderr in results:
        assert code == 0, stderr[-3000:]
        assert "done: 2 steps" in stderr + stdout
    assert "--nnodes 2 --node-rank 1 --master-addr localhost" in (shared / "train.log").read_text()
    a, b = train_records(one), train_records(shared)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    timing = ("time/", "tokens_per_s", "perf/", "mem/")
    for x, y in zip(a, b):
        keys = {k for k, v in x.items() if isinstance(v, (int, float)) and not k.startswith(timing)}
        assert {"reward", "response_len/mean", "pg/clip_frac"} <= keys and keys <= set(y)
        for key in sorted(keys):  # rewards, losses, KL, lengths: every number but the clocks
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (key, x, y)
    assert (shared / "hf" / "config.json").is_file()
