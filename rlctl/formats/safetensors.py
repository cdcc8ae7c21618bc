"""Reading a Hugging Face model directory's safetensors weights lazily, one tensor (or slice) at a time."""

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
    return json.loads(file.read_text())


class HFSafetensors:
    """``name -> lazy slice`` over the safetensors files of an HF model directory."""

    def __init__(self, hf_dir: Path):
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: hf_dir / file for name, file in weight_map.items()}
        else:
            files = sorted(hf_dir.glob("*.safetensors"))
            if not files:
                raise UserError(
                    f"no *.safetensors weights in {hf_dir}; re-save the model with "
                    "save_pretrained(..., safe_serialization=True)"
                )
            self._where = {}
            for file in files:
                with safe_open(file, framework="pt") as f:
                    self._where.update(dict.fromkeys(f.keys(), file))
        self._dir = hf_dir
        self._open: dict[Path, Any] = {}

    def __call__(self, name: str) -> Any:
        file = self._where.get(name)
        if file is None:
            raise UserError(f"HF checkpoint {self._dir} has no tensor {name}{did_you_mean(name, self._where)}")
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file].get_slice(name)
