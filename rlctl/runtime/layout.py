"""The one place that knows where a run keeps its files and how checkpoints are named.

A run directory::

    RUN/
      config.yaml  plan.json  train.log  metrics.jsonl  summary.json
      data_cache/                  # the tokenized data (datasets.map cache files), made once per run
      samples.jsonl                # RL: a few (prompt, response, reward, advantage) samples every K steps
      report.png  report.json      # `rlctl report RUN`: the curves, and the data they plot
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
    def report_png(self) -> Path:
        return self.root / "report.png"

    @property
    def report_json(self) -> Path:
        return self.root / "report.json"

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


def resolve_resume(resume: str, run_dir: str | Path) -> Path | None:
    """``checkpoint.resume``: "" -> None; "auto" -> the run's latest checkpoint or None; else a path.

    A path may name a checkpoint (step_N), a checkpoints directory or a run directory.
    """
    if not resume:
        return None
    if resume == "auto":
        return latest_checkpoint(RunPaths(Path(run_dir)).checkpoints)
    p = Path(resume).expanduser()
    if is_complete(p):
        return p
    for root in (p, RunPaths(p).checkpoints):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found is not None:
            return found
    raise UserError(
        f"--resume {resume}: no complete checkpoint there (expected a step_N directory with "
        f"trainer_state.json, or a run directory with checkpoints/)"
    )


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` so that a reader sees the old or the new content, never half of it."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: dict) -> None:
    write_text_atomic(path, json.dumps(data, indent=2) + "\n")
