"""Starting a training job: the torchrun command, the run directory, the progress bar, Ctrl-C.

:func:`build_command` gives the exact argv (also printed by ``--dry-run``); :func:`launch_job`
creates the run directory (config.yaml, plan.json), runs torchrun with the ranks' output in
RUN/train.log, draws one progress bar from rank 0's RUN/metrics.jsonl, and returns the ranks'
exit status. Ctrl-C asks the ranks to save a checkpoint and stop (a second Ctrl-C kills them).

No torch import at module level: the CLI imports this module for ``--dry-run``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from rlctl.config import RunConfig, save_config
from rlctl.errors import UserError
from rlctl.runtime.net import free_port

INTERRUPTED = 130  # exit status after a Ctrl-C that stopped the run cleanly


def _plan_get(plan, key: str, default=None):
    return plan.get(key, default) if isinstance(plan, dict) else getattr(plan, key, default)


def plan_to_dict(plan) -> dict:
    if isinstance(plan, dict):
        return plan
    if hasattr(plan, "to_dict"):
        return plan.to_dict()
    if dataclasses.is_dataclass(plan):
        return dataclasses.asdict(plan)
    return dict(vars(plan))


# ---------------------------------------------------------------------------------------------
# Run directory


def model_slug(name: str) -> str:
    """'Qwen/Qwen2.5-7B' -> 'Qwen2.5-7B'; './out/my-model/' -> 'my-model'."""
    base = Path(name.rstrip("/")).name if name else "model"
    if base == "config.json":
        base = Path(name).parent.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base) or "model"


def default_run_dir(cfg: RunConfig) -> Path:
    """runs/<method>-<model>-<YYYYmmdd-HHMMSS>; with ``resume=auto`` the newest such run that has checkpoints."""
    prefix = f"{cfg.method}-{model_slug(cfg.model.name)}-"
    if cfg.checkpoint.resume == "auto":
        runs = sorted(p for p in Path("runs").glob(prefix + "*") if (p / "checkpoints" / "latest").is_file())
        if runs:
            return runs[-1]
    return Path("runs") / (prefix + time.strftime("%Y%m%d-%H%M%S"))


# ---------------------------------------------------------------------------------------------
# Command


def build_command(cfg: RunConfig, plan, run_dir: str | Path) -> list[str]:
    """The torchrun argv that runs ``rlctl.recipes.<method>`` on this node."""
    hw = cfg.hardware
    nproc = int(_plan_get(plan, "nproc_per_node", 0) or hw.nproc or 1)
    nnodes = int(_plan_get(plan, "nodes", 0) or hw.nodes or 1)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", str(nnodes)]
    if hw.rdzv_endpoint:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", hw.rdzv_endpoint, "--rdzv-id", Path(run_dir).name]
    else:
        port = hw.master_port or (29500 if nnodes > 1 else free_port())
        argv += ["--node-rank", str(hw.node_rank), "--master-addr", hw.master_addr, "--master-port", str(port)]
    return argv + ["-m", f"rlctl.recipes.{cfg.method}", "--run-dir", str(run_dir)]


def job_env(plan, base: Mapping[str, str]) -> dict[str, str]:
    """The ranks' environment: ``base`` plus what the job needs before any CUDA call, such as the
    Megatron engine's ``CUDA_DEVICE_MAX_CONNECTIONS`` (:func:`rlctl.engines.megatron_parallel.megatron_env`)."""
    from rlctl.engines.megatron_parallel import megatron_env

    env = dict(base)
    if _plan_get(plan, "device", "cpu") == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    package_root = str(Path(__file__).resolve().parent.parent)  # so the ranks import this rlctl
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env.update(megatron_env(plan))
    return env


# ---------------------------------------------------------------------------------------------
# Progress


class _MetricsTail:
    """Reads the complete lines appended to metrics.jsonl since the last call."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        with open(self.path) as f:
            f.seek(self.pos)
            chunk = f.read()
        lines = chunk.split("\n")
        complete, self.pos = lines[:-1], self.pos + len(chunk) - len(lines[-1])
        out = []
        for line in complete:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


def _describe(rec: dict) -> str:
    parts = []
    if "reward" in rec:
        parts.append(f"reward {rec['reward']:.4g}")
    elif "loss" in rec:
        parts.append(f"loss {rec['loss']:.4g}")
    if "tokens_per_s" in rec:
        parts.append(f"{rec['tokens_per_s']:,.0f} tok/s")
    return "  ".join(parts)


class _Progress:
    """One rich progress bar on a terminal; one plain line per record otherwise (CI logs)."""

    def __init__(self, label: str):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.label = label
        self.live = self.console.is_terminal
        self.bar = None
        self.task = None
        self.last: dict | None = None

    def __enter__(self):
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.bar.__enter__()
            self.task = self.bar.add_task(self.label, total=None, info="starting (loading model and data)")
        return self

    def update(self, records: list[dict]) -> None:
        for rec in records:
            if rec.get("kind") == "eval":
                msg = f"eval at step {rec.get('step')}: " + ", ".join(
                    f"{k} {v:.4g}" for k, v in rec.items() if isinstance(v, float) and k != "time"
                )
                self.console.print(msg)
                continue
            if "step" not in rec:
                continue
            self.last = rec
            if self.live:
                self.bar.update(self.task, completed=rec["step"], total=rec.get("total_steps"), info=_describe(rec))
            else:
                self.console.print(f"step {rec['step']}/{rec.get('total_steps', '?')}  {_describe(rec)}")

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)


# ---------------------------------------------------------------------------------------------
# Launch


def _check_inputs(cfg: RunConfig, run_dir: Path) -> None:
    """Cheap checks that would otherwise fail only after torchrun has started."""
    from rlctl.metrics import check_backends_installed
    from rlctl.runtime.layout import latest_checkpoint, resolve_resume

    if cfg.data.path and not Path(cfg.data.path).expanduser().exists():
        raise UserError(f"data not found: {cfg.data.path}")
    if cfg.data.val_path and not Path(cfg.data.val_path).expanduser().exists():
        raise UserError(f"validation data not found: {cfg.data.val_path}")
    check_backends_installed(cfg.log.backends)
    resolve_resume(cfg.checkpoint.resume, run_dir)  # a bad --resume PATH fails here
    if not cfg.checkpoint.resume and latest_checkpoint(run_dir / "checkpoints") is not None:
        raise UserError(
            f"{run_dir} already holds checkpoints; pass --resume auto to continue that run "
            f"or choose another --output-dir"
        )


def _worker_pids(torchrun_pid: int) -> list[int]:
    import psutil

    try:
        children = psutil.Process(torchrun_pid).children()
    except psutil.NoSuchProcess:
        return []
    return [c.pid for c in children if "rlctl.recipes" in " ".join(_cmdline(c))]


def _cmdline(proc) -> list[str]:
    import psutil

    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _resolved(cfg: RunConfig, plan) -> RunConfig:
    """``cfg`` with the plan's decisions filled in (a no-op for a config the CLI resolved already)."""
    from types import SimpleNamespace

    from rlctl.plan import apply_plan

    fields = {"rollout_tp": 0, "rollout_mem_fraction": 0.0, **plan_to_dict(plan)}
    return apply_plan(cfg, SimpleNamespace(**fields))


def launch_job(cfg: RunConfig, plan) -> int:
    """Run the job under torchrun on this node; return the exit status (0 ok, 130 interrupted)."""
    from rlctl.runtime.layout import RunPaths

    run_dir = (Path(cfg.output_dir) if cfg.output_dir else default_run_dir(cfg)).absolute()
    _check_inputs(cfg, run_dir)
    paths = RunPaths(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (paths.error, paths.summary):
        stale.unlink(missing_ok=True)
    cfg = dataclasses.replace(_resolved(cfg, plan), output_dir=str(run_dir))
    save_config(cfg, paths.config)  # the ranks read every decision from it (plan.json is the record)
    paths.plan.write_text(json.dumps(plan_to_dict(plan), indent=2, default=str) + "\n")

    argv = build_command(cfg, plan, run_dir)
    env = job_env(plan, os.environ)

    progress = _Progress(f"{cfg.method} {model_slug(cfg.model.name)}")
    progress.console.print(f"run directory: {run_dir}  (log: {paths.train_log})")
    signals = {"count": 0}
    with open(paths.train_log, "a") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def on_signal(signum, frame):
            signals["count"] += 1
            workers = _worker_pids(proc.pid)
            if signals["count"] == 1 and workers:
                progress.console.print("stopping: the ranks save a checkpoint first (Ctrl-C again to kill them)")
                for pid in workers:
                    os.kill(pid, signal.SIGINT)
            else:  # again, or before the ranks have started: stop everything
                os.killpg(proc.pid, signal.SIGTERM if signals["count"] == 2 else signal.SIGKILL)

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        tail = _MetricsTail(paths.metrics)
        tail.pos = paths.metrics.stat().st_size if paths.metrics.is_file() else 0
        try:
            with progress:
                while proc.poll() is None:
                    progress.update(tail.read())
                    time.sleep(0.5)
                progress.update(tail.read())
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
    return _report(proc.returncode, paths, progress)


def _report(rc: int, paths, progress: _Progress) -> int:
    """Turn the ranks' outcome into the user-facing result."""
    console = progress.console
    if paths.error.is_file():
        raise UserError(paths.error.read_text().strip())
    summary = json.loads(paths.summary.read_text()) if paths.summary.is_file() else None
    if summary and summary.get("status") == "interrupted":
        console.print(f"interrupted at step {summary['step']}; checkpoint: {summary['checkpoint']}")
        console.print("continue with --resume auto (same --output-dir)")
        return INTERRUPTED
    if rc != 0 or summary is None:
        lines = paths.train_log.read_text(errors="replace").splitlines()[-25:] if paths.train_log.is_file() else []
        console.print("\n".join(lines), markup=False, highlight=False)
        console.print(f"[red]training failed[/red] (exit status {rc}); full log: {paths.train_log}")
        return rc or 1
    data = summary.get("data") or {}
    if data.get("bad"):
        reasons = "; ".join(f"{n} {r}" for r, n in data.get("reasons", {}).items())
        console.print(f"skipped {data['bad']} of {data['total']} rows: {reasons}")
    console.print(f"done: {summary['step']} steps; checkpoint: {summary['checkpoint']}")
    if summary.get("hf"):
        console.print(f"Hugging Face model: {summary['hf']}")
    return 0
