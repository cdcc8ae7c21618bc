"""One owner per run directory: RUN/.lock, taken before anything is written and before ``--resume`` reads.

Two launches into one directory would interleave metrics.jsonl and train.log, and the second would train
with the first's config.yaml. So the launcher takes the lock first (:func:`take_run_dir`), and a second
launch is refused in one line naming the owner: its pid, host and start time.

The lock is a file created with ``O_CREAT | O_EXCL`` (atomic on local file systems and on NFSv3+,
Lustre, GPFS), holding JSON: ``{"pid", "host", "started", "proc_start", "pids", "key", "token"}``. It
is broken only when its owner is gone:

* on this host: none of its processes (the launcher, then torchrun too) is alive, checked by pid and
  process start time (a reused pid is not its owner);
* on another host (a shared file system): its heartbeat stopped; a thread of the launcher touches the
  file every :data:`HEARTBEAT_S` seconds, and a lock not touched for :data:`STALE_S` seconds is its owner's remains
  (this assumes the hosts' clocks agree within a minute).

The nodes of one multi-node job share the lock: the job's ``key`` (the SLURM job id and the rendezvous
address, the same on every node) lets the other nodes in. No torch here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from rlctl.errors import UserError

LOCK_NAME = ".lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0


def _proc_start(pid: int) -> float | None:
    """When process ``pid`` started, in this host's own terms (Linux: clock ticks after boot, from
    /proc/PID/stat; elsewhere psutil's create time); None when there is no such process. Only compared
    with values read on the same host."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None if Path("/proc/self/stat").is_file() else _psutil_start(pid)
    except OSError:
        return _psutil_start(pid)
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3, starttime field 22
    return None if fields[0] in ("Z", "X") else float(fields[19])


def _psutil_start(pid: int) -> float | None:
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def _alive(pid: int, started: float | None) -> bool:
    now = _proc_start(pid)
    return now is not None and (started is None or abs(now - started) < 1.0)


@dataclasses.dataclass
class RunLock:
    """A held lock (``owner``: this process created the file; else it joined its job's lock)."""

    path: Path
    record: dict
    owner: bool
    created: Path | None  # the first directory this process created on the way (a refusal removes it again)
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def __post_init__(self):
        threading.Thread(target=self._heartbeat, daemon=True, name="rlctl-run-lock").start()

    @property
    def run_dir(self) -> Path:
        return self.path.parent

    def add_pid(self, pid: int) -> None:
        """Another process of this job (torchrun): the lock holds while any of them is alive."""
        if self.owner:
            self.record["pids"].append([pid, _proc_start(pid)])
            _write(self.path, self.record, replace=True)

    def _heartbeat(self) -> None:
        """Touch the lock every HEARTBEAT_S until released (through the checks, however long they read)."""
        while not self.stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self, *, remove_dir: bool = False) -> None:
        """Give the lock up; ``remove_dir``: this process created the directory and leaves none behind."""
        _HELD.pop(self.run_dir, None)
        self.stop.set()
        if self.owner:
            try:
                if json.loads(self.path.read_text()).get("token") == self.record["token"]:
                    self.path.unlink()
            except (OSError, ValueError):
                pass
        if self.created is None:
            return
        if remove_dir:
            import shutil

            shutil.rmtree(self.run_dir, ignore_errors=True)
        for d in (self.run_dir, *self.run_dir.parents):  # the directories it made, if empty
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                break
            if d == self.created:
                break


_HELD: dict[Path, RunLock] = {}


def held(run_dir: Path) -> RunLock | None:
    """The lock this process holds on ``run_dir``, if any."""
    return _HELD.get(Path(run_dir).absolute())


def job_key(nodes: int, hardware, environ) -> str | None:
    """What the nodes of one multi-node job share (None: a one-node job shares with no one)."""
    if nodes <= 1:
        return None
    where = hardware.rdzv_endpoint or f"{hardware.master_addr}:{hardware.master_port}"
    return f"slurm={environ.get('SLURM_JOB_ID', '')} rendezvous={where}"


def _write(path: Path, record: dict, *, replace: bool = False) -> None:
    data = json.dumps(record).encode()
    if replace:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read(path: Path) -> dict | None:
    """The lock's record; {} for a file being written or unreadable; None when there is none."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        record = json.loads(text)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def owner_gone(path: Path, record: dict, now: float | None = None) -> bool:
    """Whether the lock's owner is gone: its processes (this host), its heartbeat (another host)."""
    try:
        age = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return True
    if not record:  # being written right now, or garbage: only an old one is stale
        return age > STALE_S
    if record.get("host") == socket.gethostname():
        pids = record.get("pids") or [[record.get("pid"), record.get("proc_start")]]
        return not any(isinstance(p, int) and _alive(p, s) for p, s in pids)
    return age > STALE_S


def describe(record: dict) -> str:
    if not record:
        return "a process that is still writing the lock"
    return f"pid {record.get('pid', '?')} on host {record.get('host', '?')}, started {record.get('started', '?')}"


def _break(path: Path, record: dict) -> None:
    """Move a dead owner's lock aside (atomic: of two processes breaking it, one renames it)."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if (_read(aside) or {}).get("token") != record.get("token"):  # a new owner's lock: put it back
        try:
            os.link(aside, path)
        except OSError:
            pass
    aside.unlink(missing_ok=True)


def take_run_dir(run_dir: Path, key: str | None = None, *, notes: list[str] | None = None) -> RunLock:
    """Own ``run_dir`` (created if missing) or raise a one-line UserError naming its owner. Re-entrant:
    a lock this process holds already is returned as it is. ``notes`` gets a line when a dead owner's
    lock is broken."""
    run_dir = Path(run_dir).absolute()
    if run_dir in _HELD:
        return _HELD[run_dir]
    created = next((d for d in reversed((run_dir, *run_dir.parents)) if not d.exists()), None)
    try:
        run_dir.mkdir(parents=True)
    except FileExistsError:
        created = None
    path = run_dir / LOCK_NAME
    me = os.getpid()
    record = {
        "pid": me,
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "proc_start": _proc_start(me),
        "pids": [[me, _proc_start(me)]],
        "key": key,
        "token": secrets.token_hex(8),
    }
    for _ in range(5):
        try:
            _write(path, record)
            lock = RunLock(path, record, owner=True, created=created)
            break
        except FileExistsError:
            other = _read(path)
            if other is None:
                continue  # released meanwhile: try again
            if key is not None and other.get("key") == key:
                lock = RunLock(path, other, owner=False, created=created)  # a node of the same job
                break
            if not owner_gone(path, other):
                raise UserError(
                    f"{run_dir} is in use by another rlctl run ({describe(other)}); wait for it to end or "
                    f"choose another --output-dir (the lock, {path}, is broken only once that process is gone)"
                ) from None
            _break(path, other)
            if notes is not None:
                notes.append(f"note: took over {run_dir} from {describe(other)}, which is gone")
    else:
        raise UserError(f"{run_dir}: could not take its lock {path}; try again")
    if not _HELD:
        import atexit

        atexit.register(release_all)
    _HELD[run_dir] = lock
    return lock


def release_all() -> None:
    """Release every lock this process still holds (at exit)."""
    for lock in list(_HELD.values()):
        lock.release()
