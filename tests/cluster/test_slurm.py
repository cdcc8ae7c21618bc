"""SLURM: host lists, a node's place inside an allocation, the sbatch script line by line, submission.

``sbatch`` is not installed here: the submission test puts a fake ``sbatch`` on PATH that records its
arguments and prints a job id (a labelled boundary: SLURM itself is not exercised, the script it would
run is, by tests/cluster/test_two_nodes.py, which runs its per-node command as two simulated nodes).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from rlctl.config import build_config, dotted_to_nested
from rlctl.errors import UserError
from rlctl.slurm import allocation_options, expand_hostlist, sbatch_script
from tests.support.cli import run_cli
from tests.support.sft import chat_rows, cpu_plan, write_jsonl


@pytest.mark.parametrize(
    "spec, hosts",
    [
        ("node7", ["node7"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("gpu[08-11,20]", ["gpu08", "gpu09", "gpu10", "gpu11", "gpu20"]),
        ("a[1-2],b,c[009-010]", ["a1", "a2", "b", "c009", "c010"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("login-a[1-2]-ib,x", ["login-a1-ib", "login-a2-ib", "x"]),
    ],
)
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize("spec", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]"])
def test_bad_hostlist_is_one_line(spec):
    with pytest.raises(UserError, match="bad SLURM host list"):
        expand_hostlist(spec)


STEP = {
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NNODES": "2",
    "SLURM_NODEID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "2",
}


def test_inside_an_allocation_the_node_takes_its_place_from_slurm():
    out = allocation_options({"hardware.nodes": None, "model.name": "m"}, STEP)
    assert out["hardware.nodes"] == 2 and out["hardware.node_rank"] == 1
    assert out["hardware.master_addr"] == "gpu07"  # the first host of the list
    assert out["hardware.master_port"] == 20000 + 123456 % 20000  # the same on every node of the job
    assert out["model.name"] == "m"


def test_outside_an_allocation_or_named_nodes_change_nothing():
    opts = {"hardware.nodes": None}
    assert allocation_options(opts, {}) is opts
    assert allocation_options({"hardware.node_rank": 0}, STEP) == {"hardware.node_rank": 0}
    assert allocation_options({"hardware.rdzv_endpoint": "h:1"}, STEP) == {"hardware.rdzv_endpoint": "h:1"}
    assert allocation_options({"hardware.nodes": 1}, STEP) == {"hardware.nodes": 1}  # one node of the allocation
    one = {**STEP, "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "gpu07"}
    assert allocation_options(opts, one) is opts


def test_the_batch_script_itself_or_tasks_per_gpu_are_one_line_errors():
    no_step = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}
    for env in (no_step, {**STEP, "SLURM_STEP_ID": "4294967294"}):  # salloc's shell; the batch step
        with pytest.raises(UserError, match=r"start rlctl on every node with `srun --ntasks-per-node=1 rlctl"):
            allocation_options({}, env)
    with pytest.raises(UserError, match="srun started 16 tasks on 2 nodes; rlctl needs one per node"):
        allocation_options({}, {**STEP, "SLURM_STEP_NUM_TASKS": "16"})


def _cfg(tmp_path, **sets):
    base = {"model.name": "Qwen2.5-72B", "data.path": str(tmp_path / "d.jsonl"), **sets}
    return build_config("sft", [dotted_to_nested(base)])


def test_sbatch_script_line_by_line(tmp_path):
    cfg = _cfg(
        tmp_path,
        **{
            "cluster.launcher": "slurm",
            "cluster.partition": "gpu",
            "cluster.account": "proj1",
            "cluster.time": "12:00:00",
            "cluster.sbatch": ["--qos=high", "#SBATCH --exclusive"],
        },
    )
    plan = cpu_plan(8, device="cuda", nodes=4)
    run = tmp_path / "runs" / "r1"
    lines = sbatch_script(cfg, plan, run, cwd=Path("/home/me/proj")).splitlines()
    node = (
        f"  {sys.executable} -m rlctl sft --config {run}/job.yaml --launcher torchrun --nodes 4 --nproc 8 "
        f'--rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" --output-dir {run} --resume auto'
    )
    assert lines == [
        "#!/bin/bash",
        "#SBATCH --job-name=rlctl-sft-Qwen2.5-72B",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --time=12:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj1",
        "#SBATCH --qos=high",
        "#SBATCH --exclusive",
        f"#SBATCH --output={run}/slurm-%j.out",
        "",
        "# written by rlctl: the same rlctl command on every node; torchrun's c10d rendezvous on the first node",
        "set -euo pipefail",
        "cd /home/me/proj",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "RDZV_PORT=29500",
        "srun --nodes=4 --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        node,
    ]


def test_cpu_plan_has_no_gpu_line_and_unset_options_no_lines(tmp_path):
    lines = sbatch_script(_cfg(tmp_path), cpu_plan(2, nodes=2), tmp_path / "r").splitlines()
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert [s.split("=")[0] for s in sbatch] == [
        "#SBATCH --job-name",
        "#SBATCH --nodes",
        "#SBATCH --ntasks-per-node",
        "#SBATCH --output",
    ]


def test_a_resume_of_its_own_is_kept_in_the_job_not_overridden(tmp_path):
    cfg = _cfg(tmp_path, **{"checkpoint.resume": "/shared/old/checkpoints/step_40"})
    last = sbatch_script(cfg, cpu_plan(1), tmp_path / "r").splitlines()[-1]
    assert last.endswith(f"--output-dir {tmp_path / 'r'}") and "--resume" not in last


def test_an_extra_line_that_is_no_option_is_refused(tmp_path):
    cfg = _cfg(tmp_path, **{"cluster.sbatch": ["qos=high"]})
    with pytest.raises(UserError, match="give an sbatch option such as --sbatch=--qos=high"):
        sbatch_script(cfg, cpu_plan(1), tmp_path / "r")


@pytest.fixture
def fake_sbatch(tmp_path):
    """A fake `sbatch` on PATH (the labelled boundary): records its arguments, prints a job id."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sbatch_args.txt"
    script = bin_dir / "sbatch"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {log}\necho 4242\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, log


def _two_nodes(tiny_model_dir, data) -> list[str]:
    """`rlctl sft` on 2 nodes of 1 CPU process."""
    return [
        "sft",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data),
        "--device",
        "cpu",
        "--nodes",
        "2",
        "--nproc",
        "1",
    ]


def _job_args(tmp_path, tiny_model_dir, run):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(16))
    return [
        *_two_nodes(tiny_model_dir, data),
        "--max-steps",
        "2",
        "--launcher",
        "slurm",
        "--partition",
        "debug",
        "--time",
        "00:10:00",
        "-o",
        str(run),
    ]


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    r = run_cli(*_job_args(tmp_path, tiny_model_dir, run), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("#!/bin/bash\n#SBATCH --job-name=rlctl-sft-model\n#SBATCH --nodes=2\n")
    assert "#SBATCH --partition=debug" in r.stdout and "#SBATCH --time=00:10:00" in r.stdout
    assert not run.exists()


def test_submit_writes_the_job_and_prints_id_and_logs(tmp_path, tiny_model_dir, fake_sbatch):
    env, log = fake_sbatch
    run = tmp_path / "run"
    r = run_cli(*_job_args(tmp_path, tiny_model_dir, run), env=env)
    assert r.returncode == 0, r.stderr
    script = run / "sbatch.sh"
    assert log.read_text().split() == ["--parsable", str(script)]
    assert f"submitted batch job 4242: 2 nodes x 1 processes; script: {script}" in r.stdout
    assert f"logs: {run}/slurm-4242.out (SLURM), {run}/train.log (the ranks)" in r.stdout
    assert script.read_text().startswith("#!/bin/bash\n") and os.access(script, os.X_OK)
    job = (run / "job.yaml").read_text()
    assert "launcher: torchrun" in job and f"output_dir: {run}" in job  # the nodes launch, never resubmit
    assert not (run / "train.log").exists()  # nothing ran here


def test_submit_without_sbatch_is_one_line(tmp_path, tiny_model_dir):
    bare = tmp_path / "empty_bin"
    bare.mkdir()
    r = run_cli(*_job_args(tmp_path, tiny_model_dir, tmp_path / "run"), env={"PATH": str(bare)})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: --launcher slurm needs `sbatch` on PATH")


def test_default_run_dir_inside_a_slurm_job_is_the_same_on_every_node(tmp_path, monkeypatch):
    from rlctl.launch import default_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "987")
    assert default_run_dir(_cfg(tmp_path)) == Path("runs/sft-Qwen2.5-72B-slurm987")


def test_several_nodes_by_hand_need_an_output_dir(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    r = run_cli(*_two_nodes(tiny_model_dir, data), cwd=tmp_path, env={"SLURM_JOB_ID": ""})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "error: a run on 2 nodes needs --output-dir: the same run directory on every node, "
        "on a filesystem all nodes share"
    )
    assert not (tmp_path / "runs").exists()
