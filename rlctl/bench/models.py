"""The model a benchmark runs on: ``tiny``, a local HF directory, or a catalog name with random weights.

Nothing is downloaded. ``tiny`` is :func:`rlctl.testing.build_tiny_model`, built once into the
cache directory. A catalog name needs ``--random-init``: its config comes from the catalog
(:func:`rlctl.catalog.hf_config_dict`), the tokenizer is rlctl's small offline one (its ids are a
subset of any catalog vocabulary), and random weights are written only when the benchmark loads
weights from disk (rollout engines, TRL); training builds them in memory (``model.random_init``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlctl.catalog import resolve_model
from rlctl.catalog.spec import ModelSpec
from rlctl.errors import UserError

TINY = "tiny"
CACHE_ENV = "RLCTL_CACHE_DIR"
TINY_VERSION = 1  # bump when rlctl.testing's tiny model changes


@dataclass(frozen=True)
class BenchModel:
    """A model on disk: ``path`` holds config.json and a tokenizer (and weights unless ``random_init``)."""

    label: str  # what the user passed
    path: Path
    spec: ModelSpec
    random_init: bool  # no weights on disk: training builds random ones from the config


def cache_dir() -> Path:
    """``$RLCTL_CACHE_DIR``, else ``$XDG_CACHE_HOME/rlctl``, else ``~/.cache/rlctl``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlctl"


def _build_once(dest: Path, build) -> Path:
    """Build into a temp dir beside ``dest`` and rename it into place (a finished dir is reused)."""
    if (dest / "config.json").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        build(tmp)
        try:
            tmp.rename(dest)
        except OSError:  # another process finished first
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _has_weights(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin"))


def resolve_bench_model(name: str, *, random_init: bool = False, need_weights: bool = True) -> BenchModel:
    """Find or build the benchmark model ``name`` (see the module docstring)."""
    if name == TINY:
        from rlctl.testing import build_tiny_model

        path = _build_once(cache_dir() / f"tiny-v{TINY_VERSION}", lambda d: build_tiny_model(d, seed=0))
        return BenchModel(TINY, path, resolve_model(str(path)), False)
    local = Path(name).expanduser()
    if local.is_file() and local.name == "config.json":
        local = local.parent
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise UserError(
                f"{local} has no config.json; pass a Hugging Face model directory, `tiny`, "
                "or a catalog name with --random-init"
            )
        weights = _has_weights(local)
        if need_weights and not weights and not random_init:
            raise UserError(f"{local} holds no weights (*.safetensors); add --random-init to benchmark random ones")
        if random_init and need_weights and not weights:
            raise UserError(
                f"{local} holds no weights and this benchmark loads them from disk; use a directory with weights"
            )
        return BenchModel(name, local.absolute(), resolve_model(str(local)), random_init)
    spec = resolve_model(name)  # UserError with the closest names when unknown
    if not random_init:
        raise UserError(
            f"{spec.name}: nothing is downloaded by `rlctl bench`; add --random-init (weights built from "
            f"the catalog config) or pass a local model directory"
        )
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", spec.name)
    path = _build_once(cache_dir() / "random" / slug, lambda d: _write_config_and_tokenizer(spec, d))
    if need_weights and not _has_weights(path):
        _write_random_weights(path)
    return BenchModel(name, path, spec, not need_weights)


def _write_config_and_tokenizer(spec: ModelSpec, out: Path) -> None:
    from rlctl.catalog import hf_config_dict
    from rlctl.testing import build_tokenizer

    config = hf_config_dict(spec)
    tok = build_tokenizer(out)
    config.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}, indent=2) + "\n"
    )


def _write_random_weights(path: Path) -> None:
    """Random weights from the config, saved beside it (bf16 when the config says so)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(config, "dtype", None) or torch.float32)
    tmp = Path(tempfile.mkdtemp(prefix=".weights-", dir=path))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for f in tmp.iterdir():
            if f.suffix == ".safetensors" or f.name.endswith(".index.json"):
                f.rename(path / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def token_space(path: str | Path) -> tuple[list[int], object]:
    """(ids a random prompt may use, the tokenizer): ordinary tokens the model's vocabulary also has."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    config = json.loads((Path(path) / "config.json").read_text())
    vocab = min(len(tok), int(config.get("vocab_size") or len(tok)))
    special = set(tok.all_special_ids)
    allowed = [i for i in range(vocab) if i not in special]
    if not allowed:
        raise UserError(f"{path}: the tokenizer has no ordinary tokens to build random text from")
    return allowed, tok
