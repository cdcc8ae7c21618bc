"""What every benchmark shares: the JSON envelope (command, machine, date), measured subprocesses,
and memory sampling of other processes.

No torch import here: the CLI imports this module.
"""

from __future__ import annotations

import bisect
import datetime
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from rlctl import __version__
from rlctl.errors import UserError


def command_line() -> str:
    """The command as the user typed it, e.g. ``rlctl bench rollout --model tiny``."""
    args = sys.argv[1:]
    return "rlctl " + shlex.join(args) if args and args[0] == "bench" else shlex.join(sys.argv)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """GPU names from ``nvidia-smi -L`` (no torch/CUDA import); empty without one."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.split(":", 1)[1].split("(UUID", 1)[0].strip() for line in out.splitlines() if line.startswith("GPU ")]


def machine() -> dict:
    """The machine a figure was measured on."""
    import psutil

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "gpus": gpu_names(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "rlctl": __version__,
        "platform": platform.platform(terse=True),
    }


def envelope(kind: str, settings: dict, results: list[dict], **extra) -> dict:
    """The one JSON object a bench command prints: what ran, where, when, and its results."""
    return {
        "kind": kind,
        "command": command_line(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": settings,
        "results": results,
        **extra,
    }


def median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def relative_error(measured: float, estimated: float) -> float:
    """``(measured - estimated) / measured``: positive when the estimate is too low."""
    if measured <= 0:
        raise ValueError(f"measured must be positive, got {measured}")
    return (measured - estimated) / measured


def child_env(threads: int | None = None) -> dict[str, str]:
    """Environment for a measured child: this rlctl importable, one thread per process unless told."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_measured(code: str, *, threads: int | None = None, timeout: float | None = None) -> tuple[float, int, str]:
    """Run python ``code`` in a fresh process: (wall seconds, peak RSS bytes from the kernel, stdout).

    The peak is ``getrusage(RUSAGE_SELF).ru_maxrss`` of that process, read as its last statement.
    """
    tail = "\nimport resource as _r; print('MAXRSS', _r.getrusage(_r.RUSAGE_SELF).ru_maxrss, flush=True)"
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code + tail],
        env=child_env(threads),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"measured process failed:\n{proc.stderr[-3000:]}")
    rss_kb = int(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("MAXRSS")))
    return wall, rss_kb * 1024, proc.stdout


def stdout_value(stdout: str, key: str) -> float:
    """The number printed on the line ``KEY value``."""
    for line in stdout.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[1])
    raise RuntimeError(f"no {key} line in the measured process's output")


def _nvidia_smi(query: str, columns: int) -> list[list[str]]:
    """``nvidia-smi QUERY`` as rows of ``columns`` stripped fields (CSV, no header, no units; other lines left out)."""
    out = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=False
    ).stdout
    rows = [[x.strip() for x in line.split(",", columns - 1)] for line in out.splitlines()]
    return [r for r in rows if len(r) == columns]


def gpu_memory_used() -> dict[str, int]:
    """Memory in use on each visible GPU (``nvidia-smi``), bytes, keyed ``gpu0``, ``gpu1``, ..."""
    used = {}
    for index, mib in _nvidia_smi("--query-gpu=index,memory.used", 2):
        if index.isdigit() and mib.isdigit():
            used[f"gpu{index}"] = int(mib) * 2**20
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:  # nvidia-smi lists every GPU; keep the ones the job can see
        keep = {f"gpu{v.strip()}" for v in visible.split(",") if v.strip().isdigit()}
        used = {k: v for k, v in used.items() if k in keep} or used
    return used


def gpu_processes() -> list[dict]:
    """The processes holding GPU memory (``nvidia-smi --query-compute-apps``): pid, name, bytes, and where this
    process can see it (the same pid namespace), the start of its command line. How many there are tells the
    rank's own memory from other processes' CUDA contexts (compile workers, forked helpers)."""
    try:
        rows = _nvidia_smi("--query-compute-apps=pid,process_name,used_memory", 3)
    except (OSError, subprocess.TimeoutExpired):
        return []
    apps = []
    for parts in rows:
        if not parts[0].isdigit() or not parts[2].isdigit():
            continue
        app = {"pid": int(parts[0]), "name": parts[1], "used_bytes": int(parts[2]) * 2**20}
        try:
            import psutil

            app["cmdline"] = " ".join(psutil.Process(app["pid"]).cmdline())[:160]
        except Exception:  # another pid namespace (containers), or gone: the pid and name only
            pass
        apps.append(app)
    return apps


class ProcessSampler:
    """Samples, in a thread, the memory of the job this process starts.

    On CPU: the RSS (psutil) of each descendant process whose command line ``select`` accepts;
    ``peak`` maps ``pid<N>`` to its largest sample. With ``gpu=True``: the memory in use on each GPU
    (``nvidia-smi``, CUDA contexts included) less what was in use before the job started; ``peak``
    maps ``gpu<i>`` to its largest value. One rank per GPU makes that the rank's memory; reading
    per-GPU rather than per-process figures also works in containers, where nvidia-smi shows host
    pids. ``peak_time`` maps each key to the wall clock (``time.time()``, metrics.jsonl's ``time``) of its
    largest sample, and ``timeline`` keeps every sample as (time, the largest value over the keys): when the
    peak happened beside the job's steps and checkpoint (:func:`timeline_points`); ``processes_at_peak``, on
    GPUs, the processes holding GPU memory when the largest sample so far was taken (:func:`gpu_processes`).
    """

    def __init__(self, select: Callable[[list[str]], bool], *, interval: float = 0.05, gpu: bool = False):
        self.select, self.interval, self.gpu = select, interval, gpu
        self.peak: dict[str, int] = {}
        self.peak_time: dict[str, float] = {}
        self.timeline: list[tuple[float, int]] = []
        self.processes_at_peak: list[dict] = []
        self.samples = 0
        self._initial: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ProcessSampler:
        self.started = time.time()
        if self.gpu:
            if shutil.which("nvidia-smi") is None:
                raise UserError("GPU memory sampling needs nvidia-smi on PATH")
            self._initial = gpu_memory_used()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _rss(self) -> dict[str, int]:
        import psutil

        sizes = {}
        for child in psutil.Process().children(recursive=True):
            try:
                if self.select(child.cmdline()):
                    sizes[f"pid{child.pid}"] = child.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return sizes

    def _gpu(self) -> dict[str, int]:
        return {k: max(0, v - self._initial.get(k, 0)) for k, v in gpu_memory_used().items()}

    def _run(self) -> None:
        while not self._stop.is_set():
            sizes = self._gpu() if self.gpu else self._rss()
            now = time.time()
            new_peak = False
            for key, size in sizes.items():
                if size > self.peak.get(key, -1):
                    self.peak[key], self.peak_time[key] = size, now
                    new_peak = True
            if self.gpu and new_peak:
                self.processes_at_peak = gpu_processes()
            if any(sizes.values()):
                self.samples += 1
                self.timeline.append((now, max(sizes.values())))
            self._stop.wait(self.interval if not self.gpu else max(self.interval, 0.2))


def timeline_points(timeline: list[tuple[float, int]], start: float, most: int = 120) -> list[list[float]]:
    """``timeline`` as at most ``most`` points [seconds after ``start``, GB], each the largest value of its
    slice (a peak is never dropped by the thinning)."""
    if not timeline:
        return []
    per = -(-len(timeline) // most)
    points = []
    for i in range(0, len(timeline), per):
        part = timeline[i : i + per]
        t, v = max(part, key=lambda p: p[1])
        points.append([round(t - start, 1), round(v / 1e9, 3)])
    return points


class CpuClock:
    """Samples, in a thread, the CPU seconds (user + system, summed) of the descendant processes whose
    command line ``select`` accepts, with the wall clock (``time.time()``, metrics.jsonl's ``time``)."""

    def __init__(self, select: Callable[[list[str]], bool], *, interval: float = 0.02):
        self.select, self.interval = select, interval
        self.samples: list[tuple[float, float]] = []  # (time, CPU seconds of all of them)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._seen: dict[int, float] = {}  # pid -> its last CPU seconds (a rank that exited keeps them)

    def __enter__(self) -> CpuClock:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            for child in psutil.Process().children(recursive=True):
                try:
                    if self.select(child.cmdline()):
                        t = child.cpu_times()
                        self._seen[child.pid] = t.user + t.system
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
            self.samples.append((time.time(), sum(self._seen.values())))
            self._stop.wait(self.interval)

    def at(self, when: float) -> float:
        """CPU seconds at wall time ``when`` (linear between the two samples around it)."""
        i = bisect.bisect_left(self.samples, (when, float("-inf")))
        if i == 0 or i == len(self.samples):
            return self.samples[min(i, len(self.samples) - 1)][1]
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0) if t1 > t0 else c1
