"""MODEL_OR_RUN -> the Hugging Face model directory `rlctl eval` and `rlctl chat` load.

Accepted, checked in this order (:func:`check_source`, no torch: the CLI calls it before anything heavy):

* a Hugging Face model directory (``config.json`` in it);
* a run directory with its final export ``hf/`` (``RUN/hf/config.json``);
* a run directory, checkpoint root or step directory without an export: the checkpoint that
  ``rlctl convert fsdp-to-hf`` would take (:func:`rlctl.convert.locate.locate_checkpoint`: the step
  ``latest`` names, else the newest) is converted into a temporary directory (:func:`materialize`).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlctl.errors import UserError
from rlctl.runtime.layout import step_dirs

HF_EXPORT = "hf"  # RunPaths' final export, RUN/hf


@dataclass(frozen=True)
class ModelSource:
    """What MODEL_OR_RUN is: an HF directory to load as is, or a checkpoint to convert first."""

    kind: Literal["hf", "checkpoint"]
    path: Path
    note: str = ""


def _looks_like_checkpoint(p: Path) -> bool:
    """A step dir (DCP ``.metadata`` or verl rank files), or a dir holding step dirs (directly or in checkpoints/)."""
    if (p / ".metadata").is_file() or any(p.glob("model_world_size_*_rank_*.pt")) or (p / "actor").is_dir():
        return True
    return bool(step_dirs(p) or step_dirs(p / "checkpoints"))


def check_source(model_or_run: str | Path) -> ModelSource:
    """What ``model_or_run`` is, or a one-line UserError naming what is missing."""
    p = Path(model_or_run).expanduser()
    if not p.exists():
        raise UserError(f"{p}: no such directory; pass a Hugging Face model directory or a run directory")
    if not p.is_dir():
        raise UserError(f"{p}: not a directory; pass a Hugging Face model directory or a run directory")
    if (p / "config.json").is_file():
        return ModelSource("hf", p)
    if (p / HF_EXPORT / "config.json").is_file():
        return ModelSource("hf", p / HF_EXPORT, f"using the run's final export {p / HF_EXPORT}")
    if _looks_like_checkpoint(p):
        return ModelSource("checkpoint", p)
    raise UserError(
        f"{p}: no config.json (not a Hugging Face model directory), no {HF_EXPORT}/ export and no checkpoints "
        "(not a run directory); pass a model directory with config.json, or a run directory"
    )


@contextlib.contextmanager
def materialize(source: ModelSource, *, trust: bool = False, log=lambda msg: None) -> Iterator[Path]:
    """The HF directory of ``source``: as is, or its checkpoint converted into a temporary directory
    (removed on exit) exactly as ``rlctl convert fsdp-to-hf`` converts it (not verified: a conversion
    problem shows as a shape or load error)."""
    if source.kind == "hf":
        if source.note:
            log(source.note)
        yield source.path
        return
    from rlctl.convert.pipeline import fsdp_to_hf

    with tempfile.TemporaryDirectory(prefix="rlctl-eval-") as tmp:
        result = fsdp_to_hf(source.path, Path(tmp) / "hf", trust=trust, verify=False, progress=False)
        for note in result.notes:
            log(note)
        ckpt = result.checkpoint
        step = f" (step {ckpt.step})" if ckpt is not None and ckpt.step is not None else ""
        log(f"converted the checkpoint {ckpt.weights_dir if ckpt else source.path}{step} to a temporary HF model")
        yield result.out_dir
