"""Reading safetensors weights lazily, one tensor (or slice) at a time: the one reader of rlctl.

:class:`HFSafetensors` opens an HF model directory (``model.safetensors.index.json`` or every
``*.safetensors``), or one file (a peft ``adapter_model.safetensors``, a Megatron shard). Every file's
header is checked when it is opened, so a missing or truncated file is one :class:`UserError` naming
it, before any tensor is read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from rlctl.errors import UserError, did_you_mean


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of an HF model directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"no HF config.json at {path}; pass the HF model directory")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{file}: not valid JSON ({e}); restore the file from the original model") from None


def _open(file: Path):
    """A safetensors handle; a missing, truncated or foreign file is one line naming it."""
    if not file.is_file():
        raise UserError(f"{file}: file not found (deleted or never written); copy the complete checkpoint")
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file is the user's input
        raise UserError(f"{file}: not a readable safetensors file, damaged or truncated ({e}); copy it again") from None


class HFSafetensors:
    """``name -> lazy slice`` over the safetensors files of an HF model directory (or one file)."""

    def __init__(self, hf_dir: str | Path):
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        weight_map: dict[str, str] = {}
        if hf_dir.is_file() or hf_dir.suffix == ".safetensors":
            files = [hf_dir]
        elif index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"{index}: not a valid safetensors index ({e}); copy the model again") from None
            files = sorted({hf_dir / file for file in weight_map.values()})
        else:
            files = sorted(hf_dir.glob("*.safetensors"))
            if not files:
                raise UserError(
                    f"no *.safetensors weights in {hf_dir}; re-save the model with "
                    "save_pretrained(..., safe_serialization=True)"
                )
        self._where: dict[str, Path] = {}
        for file in files:
            with _open(file) as f:
                self._where.update(dict.fromkeys(f.keys(), file))
        if weight_map:
            absent = [name for name in weight_map if name not in self._where]
            if absent:
                raise UserError(
                    f"{weight_map[absent[0]]} in {hf_dir} has no tensor {absent[0]} that the index names; "
                    "copy the model again"
                )
        self._dir = hf_dir
        self._open: dict[Path, Any] = {}

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        file = self._where.get(name)
        if file is None:
            raise UserError(f"HF checkpoint {self._dir} has no tensor {name}{did_you_mean(name, self._where)}")
        return file

    def __call__(self, name: str) -> Any:
        file = self.file_of(name)
        if file not in self._open:
            self._open[file] = _open(file)
        return self._open[file].get_slice(name)

    def read(self, name: str):
        """The whole tensor, through a short-lived handle (the file's mapped pages do not pile up)."""
        file = self.file_of(name)
        try:
            with safe_open(str(file), framework="pt") as handle:
                return handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001 - the file changed or was damaged after opening
            raise UserError(f"{file}: cannot read {name} ({e}); copy the file again") from None
