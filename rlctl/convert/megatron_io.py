"""Megatron checkpoints on disk: rlctl's own TP/PP shard files and megatron-core ``torch_dist`` dirs.

rlctl shard layout (written by :func:`save_megatron_shards`)::

    OUT/rlctl_megatron.json                       tp, pp, vocab padding, the layout and the HF config
    OUT/mp_rank_{tp:02d}_{pp:03d}/model.safetensors  one rank's state dict (see megatron_layout)
    OUT/huggingface/                              the HF config, tokenizer and other non-weight files

A megatron-core ``dist_checkpointing`` directory (``torch_dist`` backend: ``metadata.json``,
``.metadata``, ``*.distcp``) stores every weight as one global tensor under its ``sharded_state_dict``
key: TP shards are joined (the QKV groups in order; ``linear_fc1`` as all gate rows then all up rows),
and decoder layers are stacked into ``decoder.layers.<name>`` with a leading layer dimension, or kept
per layer as ``decoder.layers.<i>.<name>`` (``linear_fc1.weight_w`` / ``_v`` for gate / up) when saved
with ``singleton_local_shards``. The global tensors are the tp=1, pp=1 layout, so they convert with
:func:`megatron_to_hf` at tp=1, pp=1, reading one layer's rows at a time.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import (
    create_read_items_for_chunk_list,
)

from rlctl.errors import UserError
from rlctl.formats.megatron_layout import (
    MegatronLayoutConfig,
    check_parallelism,
    megatron_shard_for_rank,
    megatron_to_hf,
    padded_vocab_size,
)
from rlctl.formats.safe_load import safe_dcp_reader
from rlctl.formats.safetensors import HFSafetensors, read_hf_config

META_FILE = "rlctl_megatron.json"
HF_SUBDIR = "huggingface"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

MegatronFormat = Literal["rlctl-shards", "torch_dist"]
HFConfigArg = Mapping[str, Any] | str | Path | None


def shard_dir_name(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


# ----------------------------------------------------------------------------- HF side


def _copy_hf_side_files(src: Path, dst: Path) -> None:
    """Copy config, tokenizer, generation config... (every file that is not a weight file)."""
    dst.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and not file.name.endswith(_WEIGHT_SUFFIXES) and file.name not in _WEIGHT_INDEXES:
            shutil.copy2(file, dst / file.name)


def _fresh_dir(path: Path) -> None:
    if path.exists() and any(path.iterdir()):
        raise UserError(f"output directory {path} is not empty; choose a new one or empty it")
    path.mkdir(parents=True, exist_ok=True)


# ----------------------------------------------------------------------------- rlctl shards


def save_megatron_shards(hf_dir: str | Path, out_dir: str | Path, tp: int, pp: int) -> Path:
    """Write the Megatron TP/PP shards of an HF model (safetensors weights) to ``out_dir``.

    Each rank reads only its slices of the HF tensors. Returns ``out_dir``.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    hf_config = read_hf_config(hf_dir)
    cfg = MegatronLayoutConfig.from_hf_config(hf_config)
    check_parallelism(cfg, tp, pp)
    source = HFSafetensors(hf_dir)
    _fresh_dir(out_dir)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            shard = megatron_shard_for_rank(source, cfg, tp, pp, tp_rank, pp_rank)
            rank_dir = out_dir / shard_dir_name(tp_rank, pp_rank)
            rank_dir.mkdir()
            save_file(shard, rank_dir / "model.safetensors", metadata={"format": "pt"})
    meta = {
        "format": "rlctl-megatron-shards",
        "version": 1,
        "tp": tp,
        "pp": pp,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": padded_vocab_size(cfg, tp),
        "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
        "layout": cfg.to_dict(),
        "hf_config": hf_config,
    }
    (out_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    _copy_hf_side_files(hf_dir, out_dir / HF_SUBDIR)
    return out_dir


class _ShardFiles:
    """``(tp_rank, pp_rank, name) -> lazy slice`` over ``mp_rank_*/model.safetensors``."""

    def __init__(self, ckpt_dir: Path, tp: int, pp: int):
        self._dir = ckpt_dir
        self._files = {
            (t, p): ckpt_dir / shard_dir_name(t, p) / "model.safetensors" for p in range(pp) for t in range(tp)
        }
        missing = [str(f) for f in self._files.values() if not f.is_file()]
        if missing:
            raise UserError(
                f"missing shard file {missing[0]} ({len(missing)} of {tp * pp} missing; the checkpoint "
                f"was written with tp={tp}, pp={pp}): copy the complete directory or convert again"
            )
        # opened (headers checked) up front: a truncated shard is one line before anything is written
        self._open = {rank: HFSafetensors(file) for rank, file in self._files.items()}

    def __call__(self, tp_rank: int, pp_rank: int, name: str) -> Any:
        shard = self._open[(tp_rank, pp_rank)]
        if name not in shard:
            raise UserError(f"shard {shard_dir_name(tp_rank, pp_rank)} of {self._dir} has no tensor {name}")
        return shard(name)


# ----------------------------------------------------------------------------- torch_dist


class _RegionPlanner(DefaultLoadPlanner):
    """A DCP load planner that reads a region ``(offsets, sizes)`` of each global tensor into a plain
    tensor of the region's shape (the default planner reads whole tensors or DTensor shards only)."""

    def __init__(self, regions: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._regions = regions

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, (offsets, sizes) in self._regions.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]


class _TorchDistReader:
    """``(0, 0, name) -> tensor`` of the tp=1/pp=1 layout, read from a ``torch_dist`` directory."""

    _EMBEDDING = "embedding.word_embeddings.weight"

    def __init__(self, ckpt_dir: Path, trust: bool = False):
        from rlctl.formats.integrity import check_dcp_files

        self._dir = ckpt_dir
        self._reader = safe_dcp_reader(ckpt_dir, trust=trust)
        metadata = self._reader.read_metadata()
        check_dcp_files(ckpt_dir, metadata)
        self._meta = metadata.state_dict_metadata
        model_keys = [k for k in self._meta if k.endswith(self._EMBEDDING) and not k.startswith("optimizer")]
        if not model_keys:
            raise UserError(f"{ckpt_dir} has no {self._EMBEDDING}: not a megatron-core GPTModel checkpoint")
        self._prefix = min(model_keys, key=len)[: -len(self._EMBEDDING)]

    def _parts(self, name: str) -> list[tuple[str, int | None]]:
        """The stored ``(key, layer row or None)`` whose concatenation is ``name``."""
        p = self._prefix
        match = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        candidates: list[tuple[str, int | None]] = [(p + name, None)]
        if match:
            candidates.insert(0, (f"{p}decoder.layers.{match[2]}", int(match[1])))
        for key, row in candidates:
            if key in self._meta:
                return [(key, row)]
            if f"{key}_w" in self._meta and f"{key}_v" in self._meta:
                return [(f"{key}_w", row), (f"{key}_v", row)]
        raise UserError(
            f"torch_dist checkpoint {self._dir} has no tensor for {name} (looked for "
            f"{', '.join(k for k, _ in candidates)}); is the HF config the checkpoint's?"
        )

    def _read(self, key: str, row: int | None) -> torch.Tensor:
        meta = self._meta[key]
        size = tuple(meta.size)
        offsets, sizes = (0,) * len(size), size
        if row is not None:
            offsets, sizes = (row,) + offsets[1:], (1,) + size[1:]
        dest = torch.empty(sizes, dtype=meta.properties.dtype)
        planner = _RegionPlanner({key: (offsets, sizes)})
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({key: dest}, storage_reader=self._reader, planner=planner, no_dist=True)
        return dest[0] if row is not None else dest

    def __call__(self, tp_rank: int, pp_rank: int, name: str) -> torch.Tensor:
        parts = [self._read(key, row) for key, row in self._parts(name)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


# ----------------------------------------------------------------------------- detection and loading


def detect_megatron_format(path: str | Path) -> MegatronFormat | None:
    """``"rlctl-shards"``, ``"torch_dist"`` (megatron-core dist checkpoint) or None."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return "rlctl-shards"
    meta = path / "metadata.json"
    if meta.is_file():
        try:
            backend = json.loads(meta.read_text()).get("sharded_backend")
        except (json.JSONDecodeError, AttributeError):
            return None
        if backend == "torch_dist":
            return "torch_dist"
    return None


def _resolve(ckpt_dir: Path) -> tuple[Path, MegatronFormat]:
    """The checkpoint directory and its format; a verl actor dir (``dist_ckpt/``) is looked into."""
    for candidate in (ckpt_dir, ckpt_dir / "dist_ckpt"):
        fmt = detect_megatron_format(candidate)
        if fmt:
            return candidate, fmt
    if not ckpt_dir.exists():
        raise UserError(f"checkpoint directory {ckpt_dir} does not exist")
    raise UserError(
        f"{ckpt_dir} is not a Megatron checkpoint: expected {META_FILE} (rlctl shards) or a "
        "megatron-core torch_dist directory (metadata.json, .metadata, *.distcp)"
    )


def _torch_dist_hf_config(ckpt_dir: Path, hf_config: HFConfigArg) -> tuple[dict[str, Any], Path | None]:
    """The HF config for a torch_dist checkpoint and the directory holding the HF side files."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config), None
    if hf_config is not None:
        path = Path(hf_config)
        return read_hf_config(path), path if path.is_dir() else path.parent
    for guess in (ckpt_dir / HF_SUBDIR, ckpt_dir.parent / HF_SUBDIR):
        if (guess / "config.json").is_file():
            return read_hf_config(guess), guess
    raise UserError(
        f"a torch_dist checkpoint holds no HF config and none was found in {ckpt_dir / HF_SUBDIR}; "
        "pass the HF model directory the checkpoint was made from as the HF config"
    )


def _open_megatron(
    ckpt_dir: str | Path, hf_config: HFConfigArg, trust: bool = False
) -> tuple[Iterator[tuple[str, torch.Tensor]], dict[str, Any], Path | None]:
    """The HF tensor stream of a checkpoint, its HF config and the directory of its HF side files."""
    ckpt_dir, fmt = _resolve(Path(ckpt_dir))
    if fmt == "rlctl-shards":
        meta = read_hf_config(ckpt_dir / META_FILE)
        try:
            config = meta["hf_config"]
            tp, pp = int(meta["tp"]), int(meta["pp"])
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{ckpt_dir / META_FILE}: damaged, no valid {e} entry; copy the checkpoint again") from None
        source = _ShardFiles(ckpt_dir, tp, pp)
        side = ckpt_dir / HF_SUBDIR
    else:
        config, side = _torch_dist_hf_config(ckpt_dir, hf_config)
        tp = pp = 1
        source = _TorchDistReader(ckpt_dir, trust)
    cfg = MegatronLayoutConfig.from_hf_config(config)
    return megatron_to_hf(source, cfg, tp, pp), config, side if side and side.is_dir() else None


def load_megatron_to_hf(
    ckpt_dir: str | Path, hf_config: HFConfigArg = None, *, trust: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the HF ``(name, tensor)`` pairs of a Megatron checkpoint, layer by layer.

    ``ckpt_dir``: rlctl shards, a megatron-core torch_dist directory, or a verl actor directory
    holding ``dist_ckpt/``. ``hf_config`` (a config dict, an HF model dir or a config.json) is only
    read for torch_dist, and needed unless a ``huggingface/`` dir sits inside or beside the checkpoint.
    Problems with the directory are raised here, before iterating.
    """
    tensors, _, _ = _open_megatron(ckpt_dir, hf_config, trust)
    return tensors


def save_hf_from_megatron(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    hf_config: HFConfigArg = None,
    max_shard_bytes: int = 5 * 1024**3,
    *,
    trust: bool = False,
) -> Path:
    """Convert a Megatron checkpoint (see :func:`load_megatron_to_hf`) to an HF model directory.

    Streams through the shared writer (:func:`rlctl.formats.hf_writer.save_hf_model`): safetensors
    shards with an index beyond ``max_shard_bytes``, the HF config/tokenizer files kept with the
    checkpoint, written under a temporary name and renamed when complete.
    """
    import tempfile

    from rlctl.formats.hf_writer import check_out_dir, save_hf_model

    tensors, config, side = _open_megatron(ckpt_dir, hf_config, trust)
    check_out_dir(Path(out_dir).absolute(), False, inputs=[ckpt_dir, side])
    with tempfile.TemporaryDirectory(prefix="rlctl-meta-") as meta:
        meta = Path(meta)
        if side is not None:
            _copy_hf_side_files(side, meta)
        if not (meta / "config.json").is_file():
            (meta / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return save_hf_model(out_dir, tensors, meta_dir=meta, max_shard_bytes=max_shard_bytes)
