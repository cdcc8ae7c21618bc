"""Starting a training job: the torchrun command, the run directory, the progress bar, Ctrl-C.

:func:`build_command` gives the exact argv (also printed by ``--dry-run``); :func:`launch_job`
takes a job already checked (:func:`rlctl.checks.check_job`), creates the run directory (config.yaml,
plan.json), runs torchrun with the ranks' output in RUN/train.log, draws one progress bar from rank 0's
RUN/metrics.jsonl, and returns the ranks' exit status. A failed job is reported in one line: the
earliest rank error (RUN/errors/rank_N.json) that is not an interruption; torchrun's own report stays
in train.log. Ctrl-C asks the ranks to save a checkpoint and stop (a second Ctrl-C kills them);
during start-up it stops them and writes summary.json (exit 130).

The plan is the typed :class:`rlctl.plan.Plan`. This module imports neither the recipes nor
:mod:`rlctl.job` (the layout contract); the run directory's files come from :mod:`rlctl.runtime.layout`.

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
from typing import TYPE_CHECKING

from rlctl.config import RunConfig, save_config
from rlctl.errors import UserError, one_line
from rlctl.metrics import from_json
from rlctl.plan import apply_plan, save_plan
from rlctl.runtime.errors import INTERRUPTED
from rlctl.runtime.layout import RunPaths, has_checkpoint, interrupted_summary, write_json_atomic
from rlctl.runtime.net import free_port
from rlctl.terminal import inert

if TYPE_CHECKING:
    from rlctl.plan import Plan


# ---------------------------------------------------------------------------------------------
# Run directory


def model_slug(name: str) -> str:
    """'Qwen/Qwen2.5-7B' -> 'Qwen2.5-7B'; './out/my-model/' -> 'my-model'."""
    base = Path(name.rstrip("/")).name if name else "model"
    if base == "config.json":
        base = Path(name).parent.name
    return re.sub(r"[^A-Za-z0-9._-]+", "-", base) or "model"


def default_run_dir(cfg: RunConfig) -> Path:
    """runs/<method>-<model>-<YYYYmmdd-HHMMSS>; with ``resume=auto`` the newest such run that has checkpoints.

    Inside a SLURM job, runs/<method>-<model>-slurm<JOB_ID>: every node of the job names the same directory."""
    prefix = f"{cfg.method}-{model_slug(cfg.model.name)}-"
    if cfg.checkpoint.resume == "auto":
        runs = sorted(p for p in Path("runs").glob(prefix + "*") if has_checkpoint(p))
        if runs:
            return runs[-1]
    job = os.environ.get("SLURM_JOB_ID")
    return Path("runs") / (prefix + (f"slurm{job}" if job else time.strftime("%Y%m%d-%H%M%S")))


# ---------------------------------------------------------------------------------------------
# Command


RECIPE_HOOK = "RLCTL_TEST_RECIPE"  # tests only: a module run by the ranks instead of rlctl.recipes.<method>


def build_command(cfg: RunConfig, plan: Plan, run_dir: str | Path) -> list[str]:
    """The torchrun argv that runs ``rlctl.recipes.<method>`` on this node."""
    hw = cfg.hardware
    nproc = int(plan.nproc_per_node or hw.nproc or 1)
    nnodes = int(plan.nodes or hw.nodes or 1)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--nnodes", str(nnodes)]
    if hw.rdzv_endpoint:
        argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", hw.rdzv_endpoint, "--rdzv-id", Path(run_dir).name]
    else:
        port = hw.master_port or (29500 if nnodes > 1 else free_port())
        argv += ["--node-rank", str(hw.node_rank), "--master-addr", hw.master_addr, "--master-port", str(port)]
    module = os.environ.get(RECIPE_HOOK) or f"rlctl.recipes.{cfg.method}"
    return argv + ["-m", module, "--run-dir", str(run_dir)]


def job_env(plan: Plan, base: Mapping[str, str]) -> dict[str, str]:
    """The ranks' environment: ``base`` plus what the job needs before any CUDA call, such as the
    Megatron engine's ``CUDA_DEVICE_MAX_CONNECTIONS`` (:func:`rlctl.engines.megatron.parallel.megatron_env`)."""
    from rlctl.engines.megatron.parallel import megatron_env

    env = dict(base)
    if plan.device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    package_root = str(Path(__file__).resolve().parent.parent)  # so the ranks import this rlctl
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env.update(
        megatron_env(
            backend=plan.backend,
            device=plan.device,
            tp=plan.tp,
            sequence_parallel=plan.sequence_parallel,
        )
    )
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
                out.append(from_json(json.loads(line)))  # NaN written as null comes back as float nan
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
                self.console.print(inert(msg), markup=False, highlight=False)
                continue
            if "step" not in rec:
                continue
            self.last = rec
            if isinstance(rec.get("warning"), str):  # e.g. reward calls that failed (rlctl.rewards.reward_warning)
                from rich.markup import escape

                self.console.print(f"[yellow]{escape(inert(rec['warning']))}[/yellow]", soft_wrap=True, highlight=False)
            if self.live:
                self.bar.update(self.task, completed=rec["step"], total=rec.get("total_steps"), info=_describe(rec))
            else:
                self.console.print(f"step {rec['step']}/{rec.get('total_steps', '?')}  {_describe(rec)}")

    def show_samples(self, records: list[dict], per_step: int = 2) -> None:
        """The first ``per_step`` samples of each step written to samples.jsonl (RL)."""
        from rich.markup import escape

        shown: dict = {}
        for rec in records:
            step = rec.get("step")
            shown[step] = shown.get(step, 0) + 1
            if shown[step] > per_step:
                continue

            def clip(text) -> str:
                text = inert(" ".join(str(text).split()))  # a model's or a tool's bytes: shown, never obeyed
                return escape(text if len(text) <= 160 else text[:157] + "...")

            reward, adv = rec.get("reward"), rec.get("advantage")
            head = (
                f"[dim]sample at step {step}: reward {reward if reward is None else f'{reward:.3g}'}, "
                f"advantage {adv if adv is None else f'{adv:.3g}'}[/dim]"
            )
            if rec.get("messages"):  # an agent run: the whole conversation, one line per message
                turns = "".join(
                    f"\n  {clip(role) + ':':<10} {clip(text)}" for role, text in conversation(rec["messages"])
                )
                self.console.print(f"{head}{turns}", soft_wrap=True)
                continue
            self.console.print(
                f"{head}\n  prompt:   {clip(rec.get('prompt', ''))}\n  response: {clip(rec.get('response', ''))}",
                soft_wrap=True,
            )

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.__exit__(*exc)


def conversation(messages: list[dict]) -> list[tuple[str, str]]:
    """(role, text) per message of a multi-turn sample (system messages left out); an assistant's tool calls
    as ``name(arguments)`` after its text."""
    import json

    out = []
    for m in messages:
        role = str(m.get("role", "?"))
        if role == "system":
            continue
        if m.get("dropped"):  # ran, but not appended: the policy never read it (no room left)
            role += " (dropped)"
        text = str(m.get("content") or "")
        calls = [c.get("function", c) for c in m.get("tool_calls") or ()]
        text += " ".join(f" -> {c.get('name')}({json.dumps(c.get('arguments'))})" for c in calls)
        out.append((role, text.strip()))
    return out


# ---------------------------------------------------------------------------------------------
# Launch


def _worker_pids(torchrun_pid: int) -> list[int]:
    """The ranks: torchrun's child processes."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(torchrun_pid).children()]
    except psutil.NoSuchProcess:
        return []


def launch_job(cfg: RunConfig, plan: Plan) -> int:
    """Run the job under torchrun on this node; return the exit status (0 ok, 130 interrupted).

    The caller has checked the job (:func:`rlctl.checks.check_job`): the run directory is owned here
    (its lock, :mod:`rlctl.runtime.run_lock`, taken already by :func:`rlctl.job.ready_to_launch`) and
    written only now. A rank's failure comes back as one line (:func:`report_rank_errors`); a job a rank
    refuses (a UserError) before its first step leaves the directory as it was: a new one is removed."""
    from rlctl.runtime.run_lock import job_key, take_run_dir

    run_dir = (Path(cfg.output_dir) if cfg.output_dir else default_run_dir(cfg)).absolute()
    paths = RunPaths(run_dir)
    lock = take_run_dir(run_dir, job_key(plan.nodes, cfg.hardware, os.environ))
    refused = False
    try:
        previous = _RunFiles(paths)  # put back when this job stops before its first step
        rc, progress, interrupted = _run_ranks(cfg, plan, paths, lock)
        try:
            return _report(rc, paths, progress, interrupted=interrupted)
        except UserError:
            refused = not previous.advanced()
            raise
        finally:
            if rc != 0 and not previous.advanced():
                previous.restore(refused=refused)
    finally:
        lock.release(remove_dir=refused)


def _run_ranks(cfg: RunConfig, plan: Plan, paths: RunPaths, lock) -> tuple[int, _Progress, bool]:
    """Write the run's config and plan, run torchrun with a progress bar until it exits: (exit status,
    the progress, whether it was interrupted)."""
    paths.summary.unlink(missing_ok=True)
    if paths.errors.is_dir():
        for stale in paths.errors.glob("rank_*.json"):
            stale.unlink()
    # the ranks read the resolved config: every \"auto\" the plan decides is filled in
    cfg = apply_plan(dataclasses.replace(cfg, output_dir=str(paths.root)), plan)
    save_config(cfg, paths.config)
    save_plan(plan, paths.plan)

    argv = build_command(cfg, plan, paths.root)
    env = job_env(plan, os.environ)

    progress = _Progress(f"{cfg.method} {model_slug(cfg.model.name)}")
    progress.console.print(
        f"run directory: {inert(str(paths.root))}  (log: {inert(str(paths.train_log))})", soft_wrap=True
    )
    with open(paths.train_log, "a") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        lock.add_pid(proc.pid)  # the lock holds while torchrun lives, even if this process is killed
        on_signal = _Stopper(proc, progress)
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        tail, samples = _MetricsTail(paths.metrics), _MetricsTail(paths.samples)
        tail.pos = paths.metrics.stat().st_size if paths.metrics.is_file() else 0
        samples.pos = paths.samples.stat().st_size if paths.samples.is_file() else 0
        try:
            with progress:
                while proc.poll() is None:
                    progress.update(tail.read())
                    progress.show_samples(samples.read())
                    time.sleep(0.2)
                progress.update(tail.read())
                progress.show_samples(samples.read())
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
    return proc.returncode, progress, on_signal.count > 0


class _Stopper:
    """The run's SIGINT/SIGTERM handler: the first signal asks the ranks to stop (they save a checkpoint
    first); another, or one before the ranks have started, stops torchrun's process group (SIGTERM, from
    the third SIGKILL). ``count``: the signals received."""

    def __init__(self, proc: subprocess.Popen, progress: _Progress) -> None:
        self.proc, self.progress, self.count = proc, progress, 0

    def __call__(self, signum, frame) -> None:
        self.count += 1
        workers = _worker_pids(self.proc.pid)
        if self.count == 1 and workers:
            self.progress.console.print(
                "stopping: the ranks save a checkpoint first (Ctrl-C again to kill them)"
                if self.progress.last is not None
                else "stopping: the ranks stop before their first step ends (Ctrl-C again to kill them)"
            )
            for pid in workers:
                try:
                    os.kill(pid, signal.SIGINT)
                except ProcessLookupError:
                    pass
        else:  # again, or before the ranks have started: stop everything
            try:
                os.killpg(self.proc.pid, signal.SIGTERM if self.count <= 2 else signal.SIGKILL)
            except ProcessLookupError:
                pass


class _RunFiles:
    """A run directory's own files before a launch (config.yaml, plan.json, summary.json): a job that
    stops before its first step (a resume that fails on the ranks, a Ctrl-C during start-up) leaves
    them as they were, so a finished run still reads as finished; train.log keeps the attempt's
    output and errors/ its report, except after a refusal (a rank's UserError), whose one line says it
    all: then every file is as it was (train.log cut back, what the attempt added removed)."""

    def __init__(self, paths: RunPaths):
        self.paths = paths
        self.saved = {p: p.read_bytes() for p in (paths.config, paths.plan, paths.summary) if p.is_file()}
        self.saved.update({p: p.read_bytes() for p in paths.errors.glob("rank_*.json")})
        self.entries = set(os.listdir(paths.root))
        self.log_size = paths.train_log.stat().st_size if paths.train_log.is_file() else 0
        self.metrics_size = paths.metrics.stat().st_size if paths.metrics.is_file() else 0

    def advanced(self) -> bool:
        """Whether the job logged a step (metrics.jsonl grew)."""
        return (self.paths.metrics.stat().st_size if self.paths.metrics.is_file() else 0) > self.metrics_size

    def restore(self, *, refused: bool = False) -> None:
        if refused:
            import shutil

            from rlctl.runtime.run_lock import LOCK_NAME

            for name in set(os.listdir(self.paths.root)) - self.entries - {LOCK_NAME}:
                path = self.paths.root / name
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            if self.paths.train_log.is_file():
                os.truncate(self.paths.train_log, self.log_size)
            for stale in self.paths.errors.glob("rank_*.json"):
                stale.unlink()
        elif not self.saved:
            return  # a new run directory: this attempt's files are all it has
        for path in (self.paths.config, self.paths.plan, self.paths.summary):
            if path not in self.saved:
                path.unlink(missing_ok=True)
        for path, data in self.saved.items():
            if refused or path.parent == self.paths.root:
                path.write_bytes(data)


def read_rank_errors(paths: RunPaths) -> list[dict]:
    """Every readable RUN/errors/rank_N.json, earliest first."""
    found = []
    for f in sorted(paths.errors.glob("rank_*.json")) if paths.errors.is_dir() else []:
        try:
            rec = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(rec, dict) and rec.get("message"):
            found.append(rec)
    return sorted(found, key=lambda r: float(r.get("time") or 0.0))


def root_cause(errors: list[dict]) -> dict | None:
    """The earliest failure that is not an interruption (peers die later, of the broken connection)."""
    return next((e for e in errors if e.get("kind") != "interrupted"), None)


def _report(rc: int, paths: RunPaths, progress: _Progress, *, interrupted: bool = False) -> int:
    """Turn the ranks' outcome into the user-facing result: one line on failure, never torchrun's report."""
    console = progress.console
    try:
        summary = json.loads(paths.summary.read_text()) if paths.summary.is_file() else None
    except (OSError, ValueError):  # written by the ranks as they died: no summary to read
        summary = None
    cause = root_cause(read_rank_errors(paths)) if rc != 0 or summary is None else None
    if cause is not None:
        if cause.get("kind") == "user":
            raise UserError(one_line(cause["message"]))
        if not interrupted:  # after a Ctrl-C, a peer's broken connection is no internal error
            from rich.markup import escape

            rank = cause.get("rank", "?")
            where = f"traceback in {paths.rank_error(rank)}; " if isinstance(rank, int) else ""
            console.print(
                f"[red]internal error[/red] on rank {escape(inert(rank))}: {escape(inert(one_line(cause['message'])))} "
                f"({escape(where)}full log: {escape(str(paths.train_log))})",
                highlight=False,
                soft_wrap=True,
            )
            return 1
    if summary is None and interrupted:  # the ranks were killed (a second Ctrl-C) or stopped in start-up
        summary = interrupted_summary(paths)
        write_json_atomic(paths.summary, summary)
        if progress.last is None and summary["checkpoint"] is None:
            console.print("interrupted during start-up (before step 1); no checkpoint was written")
            return INTERRUPTED
        reached = f"interrupted at step {progress.last['step']}; " if progress.last is not None else ""
        last = summary["checkpoint"]
        console.print(f"{reached}the ranks were stopped before saving; last checkpoint: {last}", soft_wrap=True)
        if last is not None:
            console.print("continue with --resume auto (same --output-dir)")
        return INTERRUPTED
    if summary and summary.get("status") == "interrupted":
        console.print(f"interrupted at step {summary['step']}; checkpoint: {summary['checkpoint']}")
        console.print("continue with --resume auto (same --output-dir)")
        return INTERRUPTED
    if rc != 0 or summary is None:
        console.print(
            f"[red]training failed[/red] (exit status {rc}); the ranks' output: {paths.train_log}", soft_wrap=True
        )
        return rc or 1
    data = summary.get("data") or {}
    if data.get("bad"):
        reasons = "; ".join(f"{n} {r}" for r, n in data.get("reasons", {}).items())
        console.print(f"skipped {data['bad']} of {data['total']} rows: {inert(reasons)}", markup=False)
    console.print(f"done: {summary['step']} steps; checkpoint: {summary['checkpoint']}")
    if summary.get("hf"):
        console.print(f"Hugging Face model: {summary['hf']}")
    return 0
