"""Write a Hugging Face model directory from a stream of ``(name, tensor)`` pairs.

Used by ``rlctl convert`` and by the sft engine's final export. Tensors are written to disk as
they arrive (memory stays near the largest tensor, not the model size):

* each shard is a safetensors file whose header space is reserved up front and filled in when the
  shard closes (the format allows the header to be padded with spaces); a model that fits in
  ``_STREAM_AFTER`` bytes is buffered instead, so small models get a snug header;
* tensors whose byte size is not a multiple of 8 are held back and written at the end of their
  shard, largest item size first, so every tensor starts at an offset aligned to its item size;
* shards are named ``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``
  when there is more than one, else ``model.safetensors``;
* config.json, generation_config.json and the tokenizer files are copied from ``meta_dir``
  (``dtype``/``torch_dtype`` updated when ``dtype`` is given); ``lm_head.weight`` is dropped when
  the config ties word embeddings;
* everything is written into a temporary sibling directory renamed to ``out_dir`` at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from rlctl.errors import UserError

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}

_ST_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_STREAM_AFTER = 64 * 2**20  # buffer up to this many bytes before streaming to disk


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"|"fp16"|"fp32"`` (or a torch dtype, or None) -> torch dtype or None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use bf16, fp16 or fp32")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (the spelling config.json uses)."""
    return str(dtype).removeprefix("torch.")


def config_ties_embeddings(config: dict) -> bool:
    """Whether a config.json dict ties lm_head to the input embeddings (default: not tied)."""
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    text = config.get("text_config") or {}
    return bool(text.get("tie_word_embeddings", False))


def config_dtype(config: dict) -> torch.dtype | None:
    """The dtype a config.json declares (``dtype`` or ``torch_dtype``), or None."""
    name = config.get("dtype") or config.get("torch_dtype")
    if not isinstance(name, str):
        return None
    return getattr(torch, name.removeprefix("torch."), None)


class _Shard:
    """One safetensors file written incrementally behind a reserved, space-padded header."""

    def __init__(self, path: Path, reserve: int):
        self.path = path
        self.reserve = _round8(max(reserve, 64))
        self.entries: dict[str, dict] = {}
        self.held: list[tuple[str, torch.Tensor]] = []  # odd-sized tensors, written at close
        self.header_bound = len(_METADATA) + 2  # upper bound of the final header's length
        self.offset = 0
        self.nbytes = 0
        self._file = open(path, "wb")  # noqa: SIM115 - stays open until close()
        self._file.seek(8 + self.reserve)

    def fits_header(self, name: str, tensor: torch.Tensor) -> bool:
        return self.header_bound + _entry_len(name, tensor) <= self.reserve

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.nbytes += size
        self.header_bound += _entry_len(name, tensor)
        if size % 8:
            self.held.append((name, tensor))
        else:
            self._write(name, tensor)

    def close(self) -> list[str]:
        """Write held tensors and the header; return the tensor names in the file."""
        for name, tensor in sorted(self.held, key=lambda kv: -kv[1].element_size()):
            self._write(name, tensor)
        self.held = []
        body = ",".join(json.dumps({k: v}, separators=(",", ":"))[1:-1] for k, v in self.entries.items())
        header = ("{" + _METADATA + ("," + body if body else "") + "}").encode()
        if len(header) > self.reserve:  # cannot happen: fits_header guards every add
            raise RuntimeError(f"safetensors header overflow in {self.path}")
        self._file.seek(0)
        self._file.write(self.reserve.to_bytes(8, "little"))
        self._file.write(header.ljust(self.reserve))
        self._file.close()
        return list(self.entries)

    def _write(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.entries[name] = _entry(tensor, self.offset)
        if size:
            self._file.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        self.offset += size


_METADATA = '"__metadata__":{"format":"pt"}'


def _entry_len(name: str, tensor: torch.Tensor) -> int:
    """An upper bound of the header bytes one tensor's entry takes (offsets at 20 digits)."""
    entry = {"dtype": "F8_E4M3", "shape": list(tensor.shape), "data_offsets": [10**19, 10**19]}
    return len(json.dumps({name: entry}, separators=(",", ":"))) + 2


def _entry(tensor: torch.Tensor, offset: int) -> dict:
    if tensor.dtype not in _ST_DTYPE:
        raise UserError(f"cannot write a tensor of dtype {tensor.dtype} to safetensors")
    size = tensor.numel() * tensor.element_size()
    return {"dtype": _ST_DTYPE[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


class _ShardedWriter:
    """Splits the stream into shards of at most ``max_shard_bytes`` (a lone bigger tensor gets its own)."""

    def __init__(self, tmp: Path, max_shard_bytes: int):
        self.tmp = tmp
        self.max_shard_bytes = max_shard_bytes
        self.reserve = min(max(max_shard_bytes // 4096, 64 * 1024), 4 * 2**20)
        self.pending: list[tuple[str, torch.Tensor]] = []
        self.pending_bytes = 0
        self.shard: _Shard | None = None
        self.files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self.total_bytes += size
        if self.shard is not None:
            self._stream(name, tensor)
            return
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush_pending()
        self.pending.append((name, tensor))
        self.pending_bytes += size
        if self.pending_bytes > _STREAM_AFTER:  # too much to buffer: stream from now on
            pending, self.pending, self.pending_bytes = self.pending, [], 0
            self.shard = self._open(self.reserve)
            for n, t in pending:
                self._stream(n, t)

    def _stream(self, name: str, tensor: torch.Tensor) -> None:
        """Add to the open shard, rolling to a new one when it is full or its header space is."""
        size = tensor.numel() * tensor.element_size()
        full = self.shard.nbytes and self.shard.nbytes + size > self.max_shard_bytes
        if full or not self.shard.fits_header(name, tensor):
            self.files.append((self.shard.path, self.shard.close()))
            self.shard = self._open(self.reserve)
        self.shard.add(name, tensor)

    def finish(self) -> list[tuple[Path, list[str]]]:
        if self.shard is not None:
            self.files.append((self.shard.path, self.shard.close()))
            self.shard = None
        if self.pending:
            self._flush_pending()
        return self.files

    def _flush_pending(self) -> None:
        reserve = len(_METADATA) + 2 + sum(_entry_len(n, t) for n, t in self.pending)
        shard = self._open(reserve)
        for name, tensor in self.pending:
            shard.add(name, tensor)
        self.files.append((shard.path, shard.close()))
        self.pending, self.pending_bytes = [], 0

    def _open(self, reserve: int) -> _Shard:
        return _Shard(self.tmp / f"part-{len(self.files) + 1:05d}.safetensors", reserve)


def _copy_metadata(meta_dir: Path, dest: Path, dtype: torch.dtype | None) -> dict:
    """Copy config, generation config and tokenizer files; return the (updated) config dict."""
    config_path = meta_dir / "config.json"
    if not config_path.is_file():
        raise UserError(f"{meta_dir}: no config.json; the metadata directory must hold the HF config")
    config = json.loads(config_path.read_text())
    for item in sorted(meta_dir.iterdir()):
        if not item.is_file() or item.name == "config.json":
            continue
        if item.name.endswith(_WEIGHT_SUFFIXES) or item.name in _WEIGHT_INDEXES:
            continue
        if item.name.startswith("adapter_"):
            continue
        shutil.copy2(item, dest / item.name)
    if dtype is not None:
        keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
        for key in keys:
            config[key] = dtype_name(dtype)
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return config


def _prepare(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor.contiguous()


def temp_sibling(out_dir: Path) -> Path:
    """A fresh temporary directory next to ``out_dir`` (same filesystem, so rename is atomic)."""
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def check_out_dir(out_dir: Path, force: bool, inputs: Iterable[str | Path | None] = ()) -> None:
    """Refuse an output that is, contains or sits inside one of ``inputs`` (symlinks resolved), whatever
    ``force`` says: replacing it would destroy the input. Refuse an existing non-empty output unless
    ``force``; an existing empty directory is accepted."""
    out = Path(out_dir).resolve()
    for item in inputs:
        if item is None:
            continue
        src = Path(item).resolve()
        if out == src or src in out.parents or out in src.parents:
            how = "is" if out == src else ("is inside" if src in out.parents else "contains")
            raise UserError(
                f"output {out_dir} {how} the input {item}; writing there would destroy the input "
                "(--force does not change this): choose an OUT outside the checkpoint"
            )
    if out_dir.is_dir() and not out_dir.is_symlink() and not any(out_dir.iterdir()):
        return
    if (out_dir.exists() or out_dir.is_symlink()) and not force:
        raise UserError(f"{out_dir} already exists; pass --force to overwrite it")


def commit_dir(tmp: Path, out_dir: Path) -> None:
    """Move a finished temporary directory into place, replacing ``out_dir`` if present."""
    old = None
    if out_dir.exists() or out_dir.is_symlink():
        old = out_dir.parent / f".old-{out_dir.name}-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()


def save_hf_model(
    out_dir: str | Path,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    meta_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
    force: bool = False,
    before_commit: Callable[[Path], None] | None = None,
) -> Path:
    """Stream ``tensors`` (HF names) into a Hugging Face model directory at ``out_dir``.

    ``dtype`` casts floating-point tensors ("bf16"/"fp16"/"fp32" or a torch dtype) and updates
    config.json; None keeps them as given. ``before_commit(tmp_dir)`` runs on the finished
    temporary directory before it is renamed (to add files or verify; raising aborts the write).
    Returns ``out_dir`` as a Path.
    """
    out_dir = Path(out_dir).absolute()
    meta_dir = Path(meta_dir)
    check_out_dir(out_dir, force)
    target = resolve_dtype(dtype)
    tmp = temp_sibling(out_dir)
    try:
        config = _copy_metadata(meta_dir, tmp, target)
        tied = config_ties_embeddings(config)
        writer = _ShardedWriter(tmp, max_shard_bytes)
        seen: set[str] = set()
        for name, tensor in tensors:
            if tied and name == "lm_head.weight":
                continue
            if name in seen:
                raise ValueError(f"tensor {name} given twice")
            seen.add(name)
            writer.add(name, _prepare(tensor, target))
        files = writer.finish()
        _name_shards(tmp, files, writer.total_bytes)
        if before_commit is not None:
            before_commit(tmp)
        commit_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _name_shards(tmp: Path, files: list[tuple[Path, list[str]]], total_bytes: int) -> None:
    if not files:
        raise UserError("no tensors to write")
    if len(files) == 1:
        os.replace(files[0][0], tmp / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, (path, names) in enumerate(files, start=1):
        final = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        os.replace(path, tmp / final)
        weight_map.update({name: final for name in names})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
