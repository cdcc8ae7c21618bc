"""Turning the path a user gives into a checkpoint: what it is, where its weights and metadata are.

Accepted: an rlctl step dir (``.metadata`` + ``trainer_state.json`` + ``huggingface/``), a verl
``global_step_N`` or ``global_step_N/actor`` dir (``model_world_size_W_rank_R.pt``), or a run dir /
checkpoint root, of which the step that ``latest`` (or verl's marker) names, else the newest, is
taken. Step directory names are :mod:`rlctl.runtime.layout`'s (``step_dirs``, ``marked_step``, ``step_of``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.convert.sources import DcpSource, TensorSource, VerlSource
from rlctl.errors import UserError
from rlctl.formats.safetensors import read_hf_config
from rlctl.runtime.layout import marked_step, step_dirs, step_of

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")


@dataclass
class Checkpoint:
    """Where a checkpoint's weights and metadata are, and what it is."""

    format: str  # "rlctl-dcp" | "verl-fsdp"
    weights_dir: Path
    meta_dir: Path
    step: int | None = None
    world_size: int | None = None
    fsdp_version: int | None = None
    adapter_dir: Path | None = None
    notes: list[str] = field(default_factory=list)

    def open(self, *, trust: bool = False) -> TensorSource:
        """The checkpoint's tensors; ``trust`` unpickles its files fully (see docs/security.md)."""
        if self.format == "rlctl-dcp":
            return DcpSource(self.weights_dir, trust=trust)
        return VerlSource(self.weights_dir, self.world_size or 0, trust=trust)

    def config(self) -> dict:
        return read_hf_config(self.meta_dir)


def is_dcp_dir(path: Path) -> bool:
    return (path / ".metadata").is_file()


def rank_files(path: Path) -> dict[int, dict[int, Path]]:
    """``{world_size: {rank: file}}`` of the verl rank files in ``path``."""
    found: dict[int, dict[int, Path]] = {}
    if path.is_dir():
        for f in path.iterdir():
            m = RANK_FILE.match(f.name)
            if m:
                found.setdefault(int(m.group(1)), {})[int(m.group(2))] = f
    return found


def locate_checkpoint(path: str | Path) -> Checkpoint:
    """Resolve a step dir, a verl ``actor/`` dir or a run/checkpoint root (latest step) to a Checkpoint."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist; pass a checkpoint, a checkpoints/ directory or a run directory")
    notes: list[str] = []
    path = _latest_step(path, notes)
    if is_dcp_dir(path):
        return _rlctl_checkpoint(path, notes)
    if rank_files(path):
        return _verl_checkpoint(path, notes)
    if rank_files(path / "actor"):
        return _verl_checkpoint(path / "actor", notes)
    raise UserError(f"{path}: {describe_unknown(path)}")


def describe_unknown(path: Path) -> str:
    """Why a directory is not an FSDP checkpoint, and what to do instead."""
    if any(path.glob("*.distcp")):
        return f"{path / '.metadata'} not found: the DCP checkpoint is incomplete; copy the complete checkpoint"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "already a Hugging Face model; nothing to convert"
    if (path / "rlctl_megatron.json").is_file() or (path / "metadata.json").is_file():
        return "a Megatron checkpoint; use `rlctl convert megatron-to-hf`"
    return (
        "unknown checkpoint format: expected an rlctl step dir (.metadata + huggingface/), a verl "
        "actor dir (model_world_size_W_rank_R.pt), or a run dir holding checkpoints/ or global_step_*/"
    )


def _latest_step(path: Path, notes: list[str]) -> Path:
    """Descend from a run dir or checkpoint root to its latest step dir; other paths are returned as is."""
    if is_dcp_dir(path) or rank_files(path) or rank_files(path / "actor"):
        return path
    if not path.is_dir():
        raise UserError(f"{path}: not a directory; pass a checkpoint directory")
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = step_dirs(root)
    if not steps:
        return path
    chosen = marked_step(root, steps) or steps[max(steps)]
    notes.append(f"using the latest checkpoint {chosen} ({len(steps)} step dir(s) in {root})")
    return chosen


def _read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{file}: damaged, not valid JSON ({e}); copy it again") from None


def _require_meta(meta_dir: Path, ckpt: Path) -> Path:
    if not (meta_dir / "config.json").is_file():
        raise UserError(
            f"{ckpt}: no huggingface/config.json beside the weights; the checkpoint cannot describe its model"
        )
    return meta_dir


def _rlctl_checkpoint(path: Path, notes: list[str]) -> Checkpoint:
    step = step_of(path)
    world = None
    state_file = path / "trainer_state.json"
    if not state_file.is_file():
        raise UserError(
            f"{state_file}: file not found, so the checkpoint's save did not finish (or the file was deleted); "
            "convert a complete checkpoint"
        )
    state = _read_json(state_file)
    if not isinstance(state, dict):
        raise UserError(
            f"{state_file}: expected a JSON object, found {type(state).__name__}; "
            "the file is damaged: convert another step"
        )
    step = state.get("step", step)
    world = state.get("world_size")
    from rlctl.runtime.layout import checksum_problem

    if problem := checksum_problem(path):  # a byte changed in place (same size): named, never converted
        raise UserError(f"{path} is damaged: {problem}; copy the checkpoint again, or convert another step")
    adapter = path / "lora_adapter"
    return Checkpoint(
        format="rlctl-dcp",
        weights_dir=path,
        meta_dir=_require_meta(path / "huggingface", path),
        step=step,
        world_size=world,
        adapter_dir=adapter if adapter.is_dir() else None,
        notes=notes,
    )


def _verl_checkpoint(path: Path, notes: list[str]) -> Checkpoint:
    found = rank_files(path)
    if len(found) > 1:
        sizes = ", ".join(str(w) for w in sorted(found))
        raise UserError(f"{path}: rank files of mixed world sizes ({sizes}); remove the stale ones")
    world, ranks = next(iter(found.items()))
    version = None
    config_file = path / "fsdp_config.json"
    if config_file.is_file():
        fsdp_config = _read_json(config_file)
        if not isinstance(fsdp_config, dict):
            raise UserError(
                f"{config_file}: expected a JSON object, found {type(fsdp_config).__name__}; "
                "restore the file or delete it (the world size is then read from the rank file names)"
            )
        version = fsdp_config.get("FSDP_version")
        declared = fsdp_config.get("world_size")
        if declared is not None and int(declared) != world:
            raise UserError(
                f"{config_file}: world_size {declared} but the rank files are for world size {world}; "
                "remove the stale rank files or the wrong fsdp_config.json"
            )
    else:
        notes.append(f"no fsdp_config.json; world size {world} taken from the rank file names")
    missing = [r for r in range(world) if r not in ranks]
    if missing:
        name = f"model_world_size_{world}_rank_{missing[0]}.pt"
        raise UserError(
            f"{path / name}: file not found (missing {name}; {len(missing)} of {world} rank files absent); "
            "copy the complete checkpoint"
        )
    adapter = path / "lora_adapter"
    return Checkpoint(
        format="verl-fsdp",
        weights_dir=path,
        meta_dir=_require_meta(path / "huggingface", path),
        step=step_of(path),
        world_size=world,
        fsdp_version=version,
        adapter_dir=adapter if adapter.is_dir() else None,
        notes=notes,
    )
