"""Opening pickled checkpoint files without running their code.

``torch.load(weights_only=False)`` and ``pickle.load`` run whatever a file asks for: a crafted
checkpoint executes code the moment it is opened. Every pickle rlctl reads goes through here:

* :func:`load_pt`: a ``.pt`` file (verl's ``model_world_size_W_rank_r.pt``, rlctl's legacy ``rng``
  file) with ``torch.load(weights_only=True)`` plus the few classes those files hold (DTensor and
  its mesh and placements; numpy arrays and dtypes of an RNG state);
* :func:`load_dcp_metadata`: a torch.distributed.checkpoint ``.metadata`` file (a plain pickle by
  design) with an unpickler that admits only the DCP metadata classes;
* :class:`SafeFileSystemReader`: DCP's reader whose metadata goes through :func:`load_dcp_metadata`.

A file that needs anything else raises :class:`UntrustedCheckpoint` (one line: the file and the type
it wanted). ``trust=True`` (``--trust-checkpoint``) opts back into full unpickling, for files from a
trusted source only. See docs/security.md.
"""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path
from typing import Any

from rlctl.errors import UserError


class UntrustedCheckpoint(UserError):
    """A checkpoint file that would need an unsafe type (code execution) to be unpickled."""


def _refusal(path: Path, wanted: str) -> UntrustedCheckpoint:
    return UntrustedCheckpoint(
        f"{path}: refusing to unpickle {wanted}, which a checkpoint should not need (it could run code); "
        "if you trust where the file came from, pass --trust-checkpoint"
    )


def _pt_allowlist() -> list:
    """The classes verl's FSDP rank files and rlctl's legacy RNG files hold (measured, see tests)."""
    import numpy as np
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    allowed: list = [DTensor, DTensorSpec, TensorMeta, DeviceMesh, Shard, Replicate, torch.Size]
    try:  # torch >= 2.9 records a non-default shard order (seen on 2-D meshes) in DTensorSpec
        from torch.distributed.tensor._dtensor_spec import ShardOrderEntry

        allowed.append(ShardOrderEntry)
    except ImportError:
        pass
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    # numpy's RNG state is a uint32 array: rebuilding it needs the array, its dtype and the dtype's class
    allowed += [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    return allowed


_UNSAFE = re.compile(r"GLOBAL ([\w.]+)|but got <class '([\w.]+)'>")


def load_pt(path: str | Path, *, trust: bool = False, mmap: bool = False) -> Any:
    """``torch.load`` a ``.pt`` file on CPU without running code it may carry (unless ``trust``).

    Refused files raise :class:`UntrustedCheckpoint`; unreadable ones (truncated, not a torch file)
    a :class:`UserError` naming the file.
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: file not found (deleted or never written); copy the complete checkpoint")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if trust:
                return torch.load(path, map_location="cpu", mmap=mmap, weights_only=False)
            with torch.serialization.safe_globals(_pt_allowlist()):
                return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
        except pickle.UnpicklingError as e:
            found = _UNSAFE.search(str(e))
            if found:
                raise _refusal(path, (found.group(1) or found.group(2)).rstrip(".")) from None
            raise UserError(f"{path}: damaged or not a torch file ({_first_line(e)}); copy it again") from None
        except Exception as e:  # noqa: BLE001 - a truncated, foreign or damaged file is the user's input
            raise UserError(f"{path}: damaged or not a torch file ({_first_line(e)}); copy it again") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


# ----------------------------------------------------------------------------- DCP metadata

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_CLASSES = {
    _DCP_METADATA: {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    # megatron-core's torch_dist saves its save plans in the metadata (planner_data)
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice", "complex"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the DCP metadata classes (plus torch dtypes); anything else is refused."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        raise _refusal(self._path, f"{module}.{name}")


def load_dcp_metadata(path: str | Path, *, trust: bool = False) -> Any:
    """Unpickle a DCP ``.metadata`` file (a path to it or its checkpoint directory), refusing foreign types."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401 - imports the modules the classes live in

    path = Path(path)
    if path.is_dir():
        path = path / ".metadata"
    if not path.is_file():
        raise UserError(f"{path}: file not found (deleted or never written); copy the complete checkpoint")
    try:
        with open(path, "rb") as f:
            metadata = pickle.load(f) if trust else _MetadataUnpickler(f, path).load()
    except UntrustedCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or not a pickle: the user's file
        raise UserError(f"{path}: damaged DCP metadata ({_first_line(e)}); copy the checkpoint again") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise UserError(
            f"{path}: not DCP metadata (holds a {type(metadata).__name__}); "
            "pass a checkpoint directory rlctl or DCP wrote"
        )
    return metadata


def safe_dcp_reader(path: str | Path, *, trust: bool = False):
    """A ``torch.distributed.checkpoint.FileSystemReader`` for ``path`` whose metadata is read safely."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        _metadata = None

        def read_metadata(self, *args: Any, **kwargs: Any):
            if self._metadata is None:  # read (and checked) once, however many loads use the reader
                self._metadata = load_dcp_metadata(Path(self.path), trust=trust)
                if getattr(self._metadata, "storage_meta", None) is None:
                    self._metadata.storage_meta = StorageMeta()
                self._metadata.storage_meta.load_id = self.load_id
            return self._metadata

    return SafeFileSystemReader(str(path))
