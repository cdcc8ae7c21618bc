"""The one place that knows where a run keeps its files and how checkpoints are named.

A run directory::

    RUN/
      config.yaml  plan.json  train.log  metrics.jsonl  summary.json
      data_cache/                  # the tokenized data (datasets.map cache files), made once per run
      samples.jsonl                # RL: a few (prompt, response, reward, advantage) samples every K steps
      report.png  report.json      # `rlctl report RUN`: the curves, and the data they plot
      report.html                  # `rlctl report RUN`: every metric and the rollout browser, one file
      errors/rank_N.json           # one per rank that failed: kind, one-line message, traceback, time
      model_meta/                  # config.json + tokenizer of the trained model
      hf/                          # the final Hugging Face export
      checkpoints/
        latest                     # text: the name of the last complete checkpoint, e.g. step_000200
        step_000200/               # DCP shards + .metadata, trainer_state.json, rng/, huggingface/
        .tmp-step_000300/          # a save in progress (renamed only when every rank has finished)

rlctl writes ``step_NNNNNN`` (six digits or more). For reading, verl's layout is known too:
``global_step_N/`` directories with a ``latest_checkpointed_iteration.txt`` marker holding ``N``.
No torch here: the launcher and ``rlctl convert`` use this module before anything heavy is imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from rlctl.errors import UserError

STEP_PREFIX = "step_"
RNG_DIR = "rng"  # in a checkpoint: rank_N.json + rank_N.safetensors (older checkpoints: rank_N.pt)
TRAINER_STATE = "trainer_state.json"
TMP_PREFIX = ".tmp-"
LATEST = "latest"
VERL_LATEST = "latest_checkpointed_iteration.txt"
STEP_RE = re.compile(r"^step_(\d{6,})$")  # rlctl's own checkpoints
ANY_STEP_RE = re.compile(r"^(?:step_|global_step_)(\d+)$")  # rlctl's or verl's, for reading


@dataclass(frozen=True)
class RunPaths:
    """Every file a run writes, relative to its directory."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def plan(self) -> Path:
        return self.root / "plan.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def errors(self) -> Path:
        """One JSON file per failing rank (see :meth:`rank_error`); the launcher reports the first."""
        return self.root / "errors"

    def rank_error(self, rank: int) -> Path:
        """``{"rank", "kind": "user" | "internal" | "interrupted", "message", "traceback", "time"}``:
        ``message`` is one line, ``time`` a Unix timestamp (the first failure is the root cause)."""
        return self.errors / f"rank_{rank}.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def data_cache(self) -> Path:
        """Tokenized data (Arrow files of ``datasets.map``), named by a hash of their inputs."""
        return self.root / "data_cache"

    @property
    def samples(self) -> Path:
        return self.root / "samples.jsonl"

    @property
    def rollout_init(self) -> Path:
        """A randomly initialised model's first weights, exported by the RL trainers for the rollout engines."""
        return self.root / "rollout_init"

    @property
    def report_png(self) -> Path:
        return self.root / "report.png"

    @property
    def report_json(self) -> Path:
        return self.root / "report.json"

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    @property
    def train_log(self) -> Path:
        return self.root / "train.log"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def shared_token(self) -> Path:
        """Written by rank 0 at start, read by every other rank: is the run directory shared by all nodes?"""
        return self.root / ".shared_check"

    @property
    def sbatch_script(self) -> Path:
        """The SLURM batch script of ``--launcher slurm`` (rlctl.slurm)."""
        return self.root / "sbatch.sh"

    @property
    def job_config(self) -> Path:
        """The job as submitted by ``--launcher slurm``: the config every node's ``rlctl`` re-resolves."""
        return self.root / "job.yaml"

    @property
    def model_meta(self) -> Path:
        """config.json + tokenizer + generation_config of the trained model (copied into checkpoints)."""
        return self.root / "model_meta"


def step_name(step: int) -> str:
    """The directory name of rlctl's checkpoint after ``step`` optimizer steps."""
    return f"{STEP_PREFIX}{step:06d}"


def tmp_name(step: int) -> str:
    """Where a checkpoint is written before the atomic rename to :func:`step_name`."""
    return f"{TMP_PREFIX}{step_name(step)}"


def trash_name(name: str) -> str:
    """Where a checkpoint is moved before it is deleted (replaced or pruned): out of sight at once."""
    return f"{TMP_PREFIX}old-{name}"


def step_of(path: str | Path) -> int | None:
    """The step a checkpoint path names (``step_N`` or verl's ``global_step_N``, itself or its parent)."""
    path = Path(path)
    for part in (path.name, path.parent.name):
        if m := ANY_STEP_RE.match(part):
            return int(m.group(1))
    return None


def is_complete(path: str | Path) -> bool:
    """An rlctl checkpoint whose save finished (trainer state and DCP metadata both present)."""
    path = Path(path)
    return (path / TRAINER_STATE).is_file() and (path / ".metadata").is_file()


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete rlctl checkpoints under ``root`` (RUN/checkpoints), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_RE.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint ``latest`` names, else the newest complete one, else None."""
    root = Path(root)
    latest = root / LATEST
    if latest.is_file():
        candidate = root / latest.read_text().strip()
        if is_complete(candidate):
            return candidate
    found = list_checkpoints(root)
    return found[-1] if found else None


def has_checkpoint(run_dir: str | Path) -> bool:
    return (Path(run_dir) / "checkpoints" / LATEST).is_file()


def step_dirs(root: str | Path) -> dict[int, Path]:
    """Every step directory under ``root``, rlctl's or verl's, complete or not: {step: path}."""
    root = Path(root)
    if not root.is_dir():
        return {}
    return {int(m.group(1)): d for d in root.iterdir() if d.is_dir() and (m := ANY_STEP_RE.match(d.name))}


def marked_step(root: str | Path, steps: dict[int, Path]) -> Path | None:
    """The step directory that ``latest`` (rlctl) or ``latest_checkpointed_iteration.txt`` (verl) names."""
    root = Path(root)
    for marker in (LATEST, VERL_LATEST):
        if (root / marker).is_file():
            text = (root / marker).read_text().strip()
            for step, d in steps.items():
                if text in (d.name, str(step)):
                    return d
    return None


def rng_files(directory: str | Path, rank: int) -> tuple[Path, Path, Path]:
    """A rank's RNG files in a checkpoint's ``rng/``: (JSON, safetensors, legacy pickled ``.pt``)."""
    directory = Path(directory)
    return directory / f"rank_{rank}.json", directory / f"rank_{rank}.safetensors", directory / f"rank_{rank}.pt"


def file_sizes(checkpoint: str | Path) -> dict[str, int]:
    """{relative path: bytes} of every file of a checkpoint but trainer_state.json: the manifest that
    trainer_state.json records under ``"files"`` (rank 0 writes it last, once every rank has finished)."""
    checkpoint = Path(checkpoint)
    files = (p for p in checkpoint.rglob("*") if p.is_file() and p.name != TRAINER_STATE)
    return {str(p.relative_to(checkpoint)): p.stat().st_size for p in sorted(files)}


CHECKSUMS = "sha256"  # trainer_state.json: {relative path: hex digest} of every other file of the checkpoint


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes (read in 8 MiB blocks; hashlib releases the GIL, so threads overlap)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def file_digests(root: Path, names: list[str], threads: int = 8) -> dict[str, str | None]:
    """{name: sha256 of root/name, or None when it cannot be read}, several files at once."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str) -> str | None:
        try:
            return file_digest(root / name)
        except OSError:
            return None

    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        return dict(zip(names, pool.map(one, names)))


def checksum_problem(path: str | Path) -> str | None:
    """None when every file of the checkpoint has the sha256 it was saved with (trainer_state.json's
    ``"sha256"``; checkpoints saved before it: None), else one phrase naming the first file that
    differs. Reads every byte (about a second per GB on one core; files are hashed 8 at a time)."""
    path = Path(path)
    try:
        sums = json.loads((path / TRAINER_STATE).read_text()).get(CHECKSUMS)
    except (OSError, ValueError, AttributeError):
        return None  # checkpoint_problem names an unreadable trainer state
    if not isinstance(sums, dict) or not sums:
        return None
    got = file_digests(path, sorted(sums))
    for name in sorted(sums):
        if got[name] is None:
            return f"{path / name} missing or unreadable"
        if got[name] != sums[name]:
            return f"{path / name} damaged: its bytes differ from the checksum saved with it ({CHECKSUMS})"
    return None


def _manifest_problem(path: Path, manifest: dict) -> str | None:
    for rel, size in manifest.items():
        file = path / rel
        if not file.is_file():
            return f"{file} missing"
        have = file.stat().st_size
        if have != size:
            return (
                f"{file} truncated: {have} of {size} bytes"
                if have < size
                else f"{file} damaged: {have} bytes, saved {size}"
            )
    return None


def checkpoint_problem(path: str | Path) -> str | None:
    """None when the rlctl checkpoint ``path`` is whole, else one phrase naming the first missing or
    damaged file ("``.../__0_0.distcp`` truncated: 1234 of 5678 bytes").

    Cheap (sizes and headers, never the tensors): trainer_state.json parses; every file its manifest
    (``"files"``, :func:`file_sizes`) names has the size it was saved with; every engine directory's
    DCP ``.metadata`` unpickles and each shard file it names holds the bytes it records (Megatron: and
    its metadata.json parses); each saving rank's RNG files are whole; huggingface/*.json and the LoRA
    adapter configs parse. Imports torch (the DCP metadata classes) when called.
    """
    from rlctl.formats.integrity import dcp_dir_problem, json_problem, safetensors_problem

    path = Path(path)
    if not path.is_dir():
        return f"{path} missing"
    if problem := json_problem(path / TRAINER_STATE, required=("step",)):
        return problem
    state = json.loads((path / TRAINER_STATE).read_text())
    if isinstance(state.get("files"), dict) and (problem := _manifest_problem(path, state["files"])):
        return problem  # checkpoints saved before the manifest: the checks below only
    subs = [""] + (["critic"] if state.get("method") == "ppo" or (path / "critic").is_dir() else [])
    for sub in subs:
        where = path / sub if sub else path
        if problem := dcp_dir_problem(where):
            return problem
        if state.get("backend") == "megatron" and (problem := json_problem(where / "metadata.json")):
            return problem
    rng = path / RNG_DIR
    world = state.get("world_size")
    saved = {int(f.stem[5:]) for f in rng.glob("rank_*.*") if f.stem[5:].isdigit()}
    ranks = range(world) if isinstance(world, int) else sorted(saved)
    for rank in ranks:
        as_json, as_tensors, legacy = rng_files(rng, rank)
        if legacy.is_file() and not as_json.exists() and not as_tensors.exists():
            if legacy.stat().st_size == 0:
                return f"{legacy} damaged (empty)"
            continue
        if problem := json_problem(as_json, required=("python", "numpy")) or safetensors_problem(as_tensors):
            return problem
    hf = path / "huggingface"  # written when the run has model_meta/ (always, for the CLI's runs)
    for file in ([hf / "config.json"] if hf.is_dir() else []) + sorted(hf.glob("*.json")):
        if problem := json_problem(file):
            return problem
    for sub, key in (("", "lora"), ("critic", "critic_lora")):
        if state.get(key) and (problem := json_problem(path / sub / "lora_adapter" / "adapter_config.json")):
            return problem
    return None


@dataclass(frozen=True)
class ResumeChoice:
    """Where a run resumes from: ``path`` (None: from step 0) and the newer checkpoints passed over."""

    path: Path | None
    passed_over: tuple[tuple[Path, str], ...] = ()  # (checkpoint, its problem), newest first

    def note(self) -> str:
        """One line for the console and train.log ("" when there is nothing to say)."""
        if self.path is None or not self.passed_over:
            return ""
        why = "; ".join(f"{d.name} is damaged ({problem})" for d, problem in self.passed_over)
        return f"resuming from {self.path.name}: {why}"


def resume_problem(path: Path, checksums: bool) -> str | None:
    """:func:`checkpoint_problem`, then (``checksums``) :func:`checksum_problem`."""
    return checkpoint_problem(path) or (checksum_problem(path) if checksums else None)


def choose_resume(resume: str, run_dir: str | Path, *, checksums: bool = True) -> ResumeChoice:
    """``checkpoint.resume``: "" -> no resume; "auto" -> the newest INTACT checkpoint of the run (newer
    damaged ones are passed over and named in :meth:`ResumeChoice.note`; none at all -> step 0; only
    damaged ones -> UserError); else a path, which must be intact (never a silent fallback).

    A path may name a checkpoint (step_N), a checkpoints directory or a run directory (then the
    checkpoint ``latest`` names, else the newest). ``.tmp-*`` directories (unfinished saves) are ignored.
    ``checksums``: every file's bytes are checked against the sha256 saved with it too.
    """
    if not resume:
        return ResumeChoice(None)
    if resume == "auto":
        return _newest_intact(RunPaths(Path(run_dir)).checkpoints, checksums)
    p = Path(resume).expanduser()
    if p.name.startswith(TMP_PREFIX):
        raise UserError(
            f"--resume {resume}: an unfinished save (the run stopped while writing or deleting it), not a "
            f"checkpoint; pass a step_N directory, or --resume auto"
        )
    if (STEP_RE.match(p.name) and p.is_dir()) or (p / TRAINER_STATE).exists() or (p / ".metadata").exists():
        candidate = p
    else:
        candidate = None
        for root in (p, RunPaths(p).checkpoints):
            steps = {s: d for s, d in step_dirs(root).items() if STEP_RE.match(d.name)}
            if steps:
                candidate = marked_step(root, steps) or steps[max(steps)]
                break
    if candidate is None:
        raise UserError(
            f"--resume {resume}: no complete checkpoint there (expected a step_N directory with "
            f"trainer_state.json, or a run directory with checkpoints/)"
        )
    if problem := resume_problem(candidate, checksums):
        raise UserError(
            f"--resume {resume}: checkpoint {candidate.name} is damaged: {problem}; copy it again, or pass "
            f"an older step_N directory (--resume auto takes the run's newest intact checkpoint)"
        )
    return ResumeChoice(candidate)


def _newest_intact(root: Path, checksums: bool) -> ResumeChoice:
    steps = {s: d for s, d in step_dirs(root).items() if STEP_RE.match(d.name)}
    passed: list[tuple[Path, str]] = []
    for step in sorted(steps, reverse=True):
        problem = resume_problem(steps[step], checksums)
        if problem is None:
            return ResumeChoice(steps[step], tuple(passed))
        passed.append((steps[step], problem))
    if passed:
        why = "; ".join(f"{d.name}: {problem}" for d, problem in passed)
        raise UserError(
            f"--resume auto: no intact checkpoint in {root} ({why}); copy the damaged files again, or "
            f"start over in another --output-dir"
        )
    return ResumeChoice(None)


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """The checkpoint :func:`choose_resume` picks (None: start from step 0)."""
    return choose_resume(resume, run_dir).path


def interrupted_summary(paths: RunPaths) -> dict:
    """summary.json of a run stopped before its loop could write one (a second Ctrl-C, a kill): its last
    checkpoint, if any, and that checkpoint's step (0 when there is none)."""
    last = latest_checkpoint(paths.checkpoints)
    step = (step_of(last) or 0) if last else 0
    return {"status": "interrupted", "step": step, "checkpoint": str(last) if last else None, "hf": None}


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees the old or the new content, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
