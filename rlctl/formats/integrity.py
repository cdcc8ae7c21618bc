"""Cheap checks that checkpoint files are whole, before anything loads them.

Each ``*_problem`` function returns None for a file that looks whole, or one short phrase naming the
file and what is wrong with it ("``.../__0_0.distcp`` truncated: 1234 of 5678 bytes"). They read
headers and sizes only, never the tensors: a torch.distributed.checkpoint directory is whole when its
``.metadata`` unpickles (through :func:`rlctl.formats.safe_load.load_dcp_metadata`) and every shard
file it names holds at least the bytes it records; a safetensors file when its header parses and the
file is as long as the header says; a JSON file when it parses. Used by ``rlctl convert`` (which
raises at the first problem) and by resume (which names the damaged file, or passes over a damaged
checkpoint for ``--resume auto``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from rlctl.errors import UserError


def _bad_shard(path: Path, metadata) -> tuple[Path, int | None, int] | None:
    """(file, bytes it has or None when missing, bytes it needs) of the first bad shard file, or None."""
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = info.relative_path
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        file = Path(path) / rel
        if not file.is_file():
            return file, None, size
        if file.stat().st_size < size:
            return file, file.stat().st_size, size
    return None


def dcp_files_problem(path: Path, metadata) -> str | None:
    """The first shard file the DCP ``metadata`` names that is missing or shorter than it records."""
    bad = _bad_shard(path, metadata)
    if bad is None:
        return None
    file, have, size = bad
    return f"{file} missing" if have is None else f"{file} truncated: {have} of {size} bytes"


def check_dcp_files(path: Path, metadata) -> None:
    """Every shard file the DCP metadata names exists and holds the bytes it is said to hold."""
    bad = _bad_shard(path, metadata)
    if bad is None:
        return
    file, have, size = bad
    if have is None:
        raise UserError(f"{file}: shard file not found (deleted or never written); copy the complete checkpoint")
    raise UserError(f"{file}: truncated shard file ({have} bytes, the metadata needs {size}); copy it again")


def dcp_dir_problem(path: Path) -> str | None:
    """A DCP checkpoint directory: its ``.metadata`` (present, unpicklable safely) and every shard file."""
    from rlctl.formats.safe_load import UntrustedCheckpoint, load_dcp_metadata

    meta = Path(path) / ".metadata"
    if not meta.is_file():
        return f"{meta} missing"
    try:
        metadata = load_dcp_metadata(meta)
    except UntrustedCheckpoint:
        raise  # not damage: a file that wants code run; the caller must not pass over it silently
    except UserError as e:
        return f"{meta} damaged ({_reason(str(e), meta)})"
    return dcp_files_problem(Path(path), metadata)


def json_problem(path: Path, *, required: tuple[str, ...] = ()) -> str | None:
    """A JSON object file: present, parses, and holds the ``required`` keys."""
    if not path.is_file():
        return f"{path} missing"
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        return f"{path} damaged (not JSON: {str(e).splitlines()[0][:80]})"
    if not isinstance(data, dict) or any(k not in data for k in required):
        return f"{path} damaged (no {', '.join(required)})" if required else f"{path} damaged (not a JSON object)"
    return None


def safetensors_problem(path: Path) -> str | None:
    """A safetensors file: present, its header parses, and it is as long as the header's offsets say."""
    if not path.is_file():
        return f"{path} missing"
    have = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if 8 + n > have:
                return f"{path} truncated: {have} bytes, the header alone needs {8 + n}"
            header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError):
        return f"{path} damaged (no safetensors header)"
    if have < 8 + n + end:
        return f"{path} truncated: {have} of {8 + n + end} bytes"
    return None


def _reason(message: str, path: Path) -> str:
    """The middle of a safe_load message ("PATH: damaged DCP metadata (WHY); copy ...") -> WHY."""
    text = message.removeprefix(f"{path}: ")
    if "(" in text and ")" in text:
        return text[text.index("(") + 1 : text.rindex(")")]
    return text
