"""SLURM: a batch script for ``--launcher slurm``, and a node's place from inside an allocation.

``rlctl sft|grpo|ppo ... --launcher slurm`` writes RUN/job.yaml (the resolved job, the config every node
re-reads) and RUN/sbatch.sh (:func:`sbatch_script`): ``#SBATCH`` lines for the nodes and the GPUs per node
of the plan, the time limit, partition, account and any extra lines, then one ``srun`` that starts the same
``rlctl`` command once on every node, torchrun's c10d rendezvous on the allocation's first node.
:func:`submit` hands it to ``sbatch`` and returns the job id.

From inside an allocation (``SLURM_JOB_ID`` set, e.g. ``srun --ntasks-per-node=1 rlctl sft ...``),
:func:`allocation_options` fills the node count, this node's rank and node 0's address from SLURM's
variables (``SLURM_NNODES``, ``SLURM_NODEID``, ``SLURM_JOB_NODELIST``, whose compressed host list
:func:`expand_hostlist` expands), unless the command sets them itself.

No torch import: the CLI imports this module for ``--dry-run``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlctl.config import RunConfig, save_config
from rlctl.errors import UserError
from rlctl.runtime.layout import RunPaths

if TYPE_CHECKING:
    from rlctl.plan import Plan

RDZV_PORT = 29500  # torchrun's c10d store on the first node of the allocation
BASE_PORT = 20000  # inside an allocation: node 0's port is BASE_PORT + job id % 20000 (the same on every node)
BATCH_STEPS = ("4294967294", "4294967295", "batch", "extern")  # the batch script's own step: not an srun task


# ---------------------------------------------------------------------------------------------
# Host lists


def _split_top(spec: str) -> list[str]:
    """Split at the commas outside brackets: 'a[1-2],b' -> ['a[1-2]', 'b']."""
    parts, depth, cur = [], 0, ""
    for ch in spec:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UserError(f"bad SLURM host list {spec!r}: ']' without '['")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise UserError(f"bad SLURM host list {spec!r}: '[' without ']'")
    return [p for p in [*parts, cur] if p]


def _expand_range(body: str, spec: str) -> list[str]:
    out = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise UserError(f"bad SLURM host list {spec!r}: cannot read the range '{item}'")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise UserError(f"bad SLURM host list {spec!r}: the range '{item}' runs backwards")
        width = len(lo) if lo.startswith("0") else 0  # node[001-010]: zero-padded to the lower bound's width
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


def _expand_one(host: str, spec: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", host)
    if not m:
        return [host]
    head, tail = host[: m.start()], host[m.end() :]
    return [h for n in _expand_range(m.group(1), spec) for h in _expand_one(head + n + tail, spec)]


def expand_hostlist(spec: str) -> list[str]:
    """SLURM's compressed host list, in order: 'gpu[01-03,7],login-a[1-2]-ib' -> gpu01, gpu02, gpu03,
    gpu07, login-a1-ib, login-a2-ib (what ``scontrol show hostnames`` prints)."""
    return [h for part in _split_top(spec.strip()) for h in _expand_one(part, spec)]


# ---------------------------------------------------------------------------------------------
# Inside an allocation


@dataclass(frozen=True)
class Allocation:
    job_id: str
    hosts: list[str]
    nodes: int
    node_rank: int
    in_step: bool  # started by srun (every node runs the command), not the batch script itself
    tasks: int  # tasks of the step (srun); one per node is what rlctl needs

    @property
    def master_port(self) -> int:
        digits = re.sub(r"\D", "", self.job_id) or "0"
        return BASE_PORT + int(digits) % 20000


def allocation(env: Mapping[str, str]) -> Allocation | None:
    """This node's place in the SLURM allocation, or None outside one."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        return None
    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    nodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or len(hosts) or 1)
    if hosts and len(hosts) != nodes:
        raise UserError(f"SLURM_JOB_NODELIST names {len(hosts)} hosts but SLURM_NNODES is {nodes}")
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or nodes)
    step = env.get("SLURM_STEP_ID", "")
    in_step = bool(step) and step not in BATCH_STEPS
    return Allocation(job, hosts, nodes, int(env.get("SLURM_NODEID") or 0), in_step, tasks)


def allocation_options(options: dict, env: Mapping[str, str]) -> dict:
    """``options`` with the node count, node rank and node 0's address of the SLURM allocation filled in
    (the user runs the same command on every node with ``srun``); unchanged outside an allocation, on one
    node, or when the command names its nodes itself (--node-rank, --master-addr, --rdzv-endpoint, or
    another --nodes)."""
    alloc = allocation(env)
    own = ("hardware.node_rank", "hardware.master_addr", "hardware.rdzv_endpoint")
    if alloc is None or alloc.nodes == 1 or any(options.get(k) is not None for k in own):
        return options
    if options.get("hardware.nodes") not in (None, alloc.nodes):
        return options
    if not alloc.in_step:
        raise UserError(
            f"this SLURM allocation has {alloc.nodes} nodes: start rlctl on every node with "
            f"`srun --ntasks-per-node=1 rlctl ...` (or pass --nodes 1 for a one-node run here)"
        )
    if alloc.tasks != alloc.nodes:
        raise UserError(
            f"srun started {alloc.tasks} tasks on {alloc.nodes} nodes; rlctl needs one per node "
            f"(torchrun starts the processes of a node): `srun --ntasks-per-node=1 rlctl ...`"
        )
    if not alloc.hosts:
        raise UserError("SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not; run rlctl through srun")
    return {
        **options,
        "hardware.nodes": alloc.nodes,
        "hardware.node_rank": alloc.node_rank,
        "hardware.master_addr": alloc.hosts[0],
        "hardware.master_port": options.get("hardware.master_port") or alloc.master_port,
    }


# ---------------------------------------------------------------------------------------------
# The batch script


def node_command(cfg: RunConfig, plan: Plan, run_dir: Path) -> list[str]:
    """The command every node runs (``$HEAD_NODE``/``$RDZV_PORT`` are the script's variables). Without a
    --resume of its own, the job resumes from its latest checkpoint when SLURM requeues it (a fresh
    submission has none: the check before submitting refuses a run directory that holds some)."""
    resume = [] if cfg.checkpoint.resume else ["--resume", "auto"]
    return [
        sys.executable,
        "-m",
        "rlctl",
        cfg.method,
        "--config",
        str(RunPaths(run_dir).job_config),
        "--launcher",
        "torchrun",
        "--nodes",
        str(plan.nodes),
        "--nproc",
        str(plan.nproc_per_node),
        "--rdzv-endpoint",
        "$HEAD_NODE:$RDZV_PORT",
        "--output-dir",
        str(run_dir),
        *resume,
    ]


def _quote(arg: str) -> str:
    return f'"{arg}"' if "$" in arg else shlex.quote(arg)


def sbatch_script(cfg: RunConfig, plan: Plan, run_dir: Path, *, cwd: Path | None = None) -> str:
    """The batch script of the job: one ``srun`` task per node, each running :func:`node_command`."""
    from rlctl.launch import model_slug

    c = cfg.cluster
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=rlctl-{cfg.method}-{model_slug(cfg.model.name)}",
        f"#SBATCH --nodes={plan.nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if plan.device == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={plan.nproc_per_node}")
    if c.time:
        lines.append(f"#SBATCH --time={c.time}")
    if c.partition:
        lines.append(f"#SBATCH --partition={c.partition}")
    if c.account:
        lines.append(f"#SBATCH --account={c.account}")
    for extra in c.sbatch:
        extra = extra.strip().removeprefix("#SBATCH").strip()
        if not extra.startswith("-"):
            raise UserError(f"--sbatch {extra!r}: give an sbatch option such as --sbatch=--qos=high")
        lines.append(f"#SBATCH {extra}")
    lines += [
        f"#SBATCH --output={run_dir / 'slurm-%j.out'}",
        "",
        "# written by rlctl: the same rlctl command on every node; torchrun's c10d rendezvous on the first node",
        "set -euo pipefail",
        f"cd {shlex.quote(str(cwd or Path.cwd()))}",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"RDZV_PORT={RDZV_PORT}",
        f"srun --nodes={plan.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 \\",
        "  " + " ".join(_quote(a) for a in node_command(cfg, plan, run_dir)),
        "",
    ]
    return "\n".join(lines)


def write_job(cfg: RunConfig, plan: Plan, run_dir: Path) -> Path:
    """RUN/job.yaml (the job every node re-reads, launched by torchrun there) and RUN/sbatch.sh."""
    import dataclasses

    paths = RunPaths(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    job = dataclasses.replace(
        cfg, output_dir=str(run_dir), cluster=dataclasses.replace(cfg.cluster, launcher="torchrun")
    )
    save_config(job, paths.job_config)
    paths.sbatch_script.write_text(sbatch_script(cfg, plan, run_dir))
    paths.sbatch_script.chmod(0o755)
    return paths.sbatch_script


def submit(script: Path, env: Mapping[str, str] | None = None) -> str:
    """``sbatch --parsable SCRIPT``; the job id it prints."""
    sbatch = shutil.which("sbatch", path=(env or os.environ).get("PATH"))
    if sbatch is None:
        raise UserError(
            f"--launcher slurm needs `sbatch` on PATH (run rlctl on a SLURM login node); the script is {script}"
        )
    proc = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        msg = " ".join((proc.stderr or proc.stdout).split()) or f"exit status {proc.returncode}"
        raise UserError(f"sbatch refused the job: {msg} (script: {script})")
    job = proc.stdout.strip().splitlines()[-1].split(";")[0] if proc.stdout.strip() else ""
    if not job:
        raise UserError(f"sbatch printed no job id (script: {script})")
    return job
