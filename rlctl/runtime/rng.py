"""Seeds and RNG state, saved without pickle.

A checkpoint holds each rank's RNG state in two files under ``rng/``: ``rank_N.json`` (Python's
``random`` and numpy's global state as JSON lists) and ``rank_N.safetensors`` (torch's CPU and CUDA
generator states as uint8 tensors). Checkpoints written before this format have one pickled
``rank_N.pt``; it is read through the restricted unpickler (:func:`_load_legacy`), never plain pickle.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch

from rlctl.runtime.layout import rng_files


def seed_everything(seed: int) -> None:
    """Same seed on every rank: data order is computed identically everywhere."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """This process's RNG states: {"python", "numpy", "torch", ["cuda"]} (the objects the libraries give)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rng(directory: str | Path, rank: int, state: dict) -> None:
    """Write ``state`` (from :func:`rng_state`) as JSON + safetensors into ``directory``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    as_json, as_tensors, _ = rng_files(directory, rank)
    version, internal, gauss = state["python"]
    kind, keys, pos, has_gauss, cached = state["numpy"]
    plain = {
        "format": 1,
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "kind": kind,
            "keys": np.asarray(keys).tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    as_json.write_text(json.dumps(plain) + "\n")
    tensors = {k: state[k].contiguous() for k in ("torch", "cuda") if k in state}
    save_file(tensors, str(as_tensors))


def load_rng(directory: str | Path, rank: int, *, trust: bool = False) -> dict | None:
    """This rank's RNG state from ``directory`` (new format, else an older pickled file), or None."""
    from safetensors.torch import load_file

    as_json, as_tensors, legacy = rng_files(Path(directory), rank)
    if as_json.is_file() and as_tensors.is_file():
        plain = json.loads(as_json.read_text())
        py, nps = plain["python"], plain["numpy"]
        state = {
            "python": (py["version"], tuple(py["state"]), py["gauss_next"]),
            "numpy": (
                nps["kind"],
                np.asarray(nps["keys"], dtype=np.uint32),
                nps["pos"],
                nps["has_gauss"],
                nps["cached_gaussian"],
            ),
        }
        state.update(load_file(str(as_tensors)))
        return state
    if legacy.is_file():
        return _load_legacy(legacy, trust=trust)
    return None


def _load_legacy(path: Path, *, trust: bool) -> dict:
    """An RNG file written before the JSON + safetensors format (a pickled dict), read through the
    restricted unpickler of :mod:`rlctl.formats.safe_load`: tensors, plain containers and numpy's RNG
    state only (``trust`` opts back into full unpickling for a file the user trusts)."""
    from rlctl.formats.safe_load import load_pt

    return load_pt(path, trust=trust)
