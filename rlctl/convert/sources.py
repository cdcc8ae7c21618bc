"""Where convert reads tensors from: one :class:`TensorSource` interface and its readers.

* :class:`SafetensorsSource`: an HF model directory, a peft adapter or one ``.safetensors`` file,
  through the one safetensors reader :class:`rlctl.formats.safetensors.HFSafetensors`;
* :class:`DcpSource`: rlctl's torch.distributed.checkpoint step dir (model keys ``model.<fqn>``),
  read one tensor at a time with ``dcp.load`` into empty tensors, without a process group; the
  ``.metadata`` pickle is unpickled by :func:`rlctl.formats.safe_load.load_dcp_metadata` (DCP
  classes only) and every shard file it names is checked to exist and be long enough;
* :class:`VerlSource`: verl's ``model_world_size_{W}_rank_{r}.pt`` files (DTensor shards), opened
  with :func:`rlctl.formats.safe_load.load_pt` (``weights_only``) memory-mapped, each key assembled
  from its shards on its own, so memory stays near the largest tensor rather than the model size.

Names are cleaned of FSDP/compile wrapper prefixes; peft names are resolved by :mod:`rlctl.convert.lora`.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from rlctl.errors import UserError
from rlctl.formats.integrity import check_dcp_files
from rlctl.formats.safe_load import load_pt, safe_dcp_reader
from rlctl.formats.safetensors import HFSafetensors

_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """Drop FSDP1 / activation-checkpointing / torch.compile wrapper segments from a parameter name."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


class TensorSource:
    """Random access to the tensors of a checkpoint, one key at a time."""

    def keys(self) -> list[str]:
        raise NotImplementedError

    def shape(self, key: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, key: str) -> torch.dtype:
        raise NotImplementedError

    def get(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def where(self, key: str) -> str:
        """The file a key is read from, for error messages."""
        raise NotImplementedError


class SafetensorsSource(TensorSource):
    """A directory of ``*.safetensors`` files (an HF model or a peft adapter), or one file."""

    def __init__(self, path: str | Path):
        self._st = HFSafetensors(Path(path))

    def keys(self) -> list[str]:
        return self._st.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._st(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        return _ST_DTYPES[self._st(key).get_dtype()]

    def get(self, key: str) -> torch.Tensor:
        return self._st.read(key)

    def where(self, key: str) -> str:
        return str(self._st.file_of(key))


_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class DcpSource(TensorSource):
    """The model tensors (``model.*`` keys) of a torch.distributed.checkpoint directory."""

    def __init__(self, path: Path, prefix: str = "model.", *, trust: bool = False):
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self._reader = safe_dcp_reader(path, trust=trust)
        metadata = self._reader.read_metadata()
        check_dcp_files(path, metadata)
        self._meta: dict[str, TensorStorageMetadata] = {}
        self._raw: dict[str, str] = {}
        for key, meta in metadata.state_dict_metadata.items():
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
                name = clean_name(key[len(prefix) :])
                self._meta[name] = meta
                self._raw[name] = key
        if not self._meta:
            state = path / "trainer_state.json"
            if state.is_file() and '"megatron"' in state.read_text():
                raise UserError(
                    f"{path} was written by the Megatron engine: convert it with "
                    f"`rlctl convert megatron-to-hf {path} OUT`"
                )
            raise UserError(f"{path}: the DCP checkpoint holds no '{prefix}*' tensors (not an rlctl checkpoint?)")

    def keys(self) -> list[str]:
        return list(self._meta)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._meta[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self._meta[key].properties.dtype

    def get(self, key: str) -> torch.Tensor:
        import torch.distributed.checkpoint as dcp

        tensor = torch.empty(self.shape(key), dtype=self.dtype(key))
        with _quiet():
            try:
                dcp.load({self._raw[key]: tensor}, storage_reader=self._reader, no_dist=True)
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001 - a shard changed or was damaged after the check
                raise UserError(f"{self.path}: cannot read {self._raw[key]} ({_first_line(e)})") from None
        return tensor

    def where(self, key: str) -> str:
        return str(self.path)


class VerlSource(TensorSource):
    """verl's per-rank ``model_world_size_{W}_rank_{r}.pt`` files (DTensor shards), memory-mapped."""

    def __init__(self, path: Path, world_size: int, *, trust: bool = False):
        from torch.distributed.tensor import DTensor

        self.path = path
        self.world_size = world_size
        self.files = [path / f"model_world_size_{world_size}_rank_{r}.pt" for r in range(world_size)]
        self._states = []
        with _quiet():
            for f in self.files:
                state = load_pt(f, trust=trust, mmap=True)
                if not isinstance(state, dict):
                    raise UserError(f"{f}: expected a state dict, found {type(state).__name__}")
                self._states.append({clean_name(k): v for k, v in state.items()})
        self._keys = list(self._states[0])
        self._dtensor = DTensor
        for f, state in zip(self.files[1:], self._states[1:]):
            missing = [k for k in self._keys if k not in state]
            if missing:
                raise UserError(f"{f}: missing {len(missing)} key(s) that rank 0 has, e.g. {missing[0]}")

    def keys(self) -> list[str]:
        return self._keys

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._states[0][key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._states[0][key].dtype

    def where(self, key: str) -> str:
        return str(self.files[0])

    def mesh(self) -> dict | None:
        """The device mesh of the first DTensor: ``{"shape": [...], "dims": [...]}``."""
        for value in self._states[0].values():
            if isinstance(value, self._dtensor):
                mesh = value.device_mesh
                return {"shape": list(mesh.mesh.shape), "dims": list(mesh.mesh_dim_names or [])}
        return None

    def get(self, key: str) -> torch.Tensor:
        first = self._states[0][key]
        if not isinstance(first, self._dtensor):
            return first  # buffers and plain tensors are identical on every rank: taken once
        shards = [state[key] for state in self._states]
        tensor = assemble_dtensor(key, shards, self.files)
        for shard in shards:
            release_pages(shard._local_tensor)
        return tensor


def assemble_dtensor(key: str, shards: list, files: list[Path]) -> torch.Tensor:
    """Join each rank's local shard of one DTensor into the global tensor.

    Each mesh dimension's placement cuts the tensor like ``torch.chunk`` (so an uneven last shard is
    shorter, or empty); ``Shard(d)`` splits dim d by the rank's coordinate on that mesh dimension,
    ``Replicate()`` leaves it whole. Regions already filled by another (replica) rank are skipped.
    """
    from torch.distributed.tensor import Replicate, Shard

    first = shards[0]
    spec_mesh = first.device_mesh.mesh
    placements = first.placements
    out = torch.empty(first.shape, dtype=first.dtype)
    filled: set[tuple[tuple[int, int], ...]] = set()
    for coord in _mesh_coords(spec_mesh.shape):
        rank = int(spec_mesh[coord])
        if rank >= len(shards):
            raise UserError(f"{key}: the device mesh names rank {rank} but there are only {len(shards)} rank files")
        region = [(0, n) for n in first.shape]
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                start, stop = region[placement.dim]
                k = spec_mesh.shape[mesh_dim]
                chunk = -(-(stop - start) // k)
                lo = min(start + coord[mesh_dim] * chunk, stop)
                region[placement.dim] = (lo, min(lo + chunk, stop))
            elif not isinstance(placement, Replicate):
                raise UserError(
                    f"{files[rank]}: {key} has placement {placement}; only Shard and Replicate are supported"
                )
        region_key = tuple(region)
        if region_key in filled:
            continue
        local = shards[rank]
        local = local._local_tensor if hasattr(local, "_local_tensor") else local
        want = tuple(stop - start for start, stop in region)
        if tuple(local.shape) != want:
            raise UserError(
                f"{files[rank]}: {key} shard has shape {list(local.shape)}, expected {list(want)} "
                f"for global shape {list(first.shape)} with placements {placements}"
            )
        out[tuple(slice(start, stop) for start, stop in region)] = local
        filled.add(region_key)
    return out


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the memory-mapped pages of a tensor read from a file (Linux; elsewhere a no-op).

    The rank files are mapped privately and never written, so dropped pages are simply read from
    the file again if touched; without this the whole checkpoint would stay resident.
    """
    if not _MADVISE:
        return
    start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * tensor.element_size()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
    if last > first:
        _MADVISE(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _libc_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _libc_madvise()
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def _mesh_coords(shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every coordinate of a mesh in row-major (rank) order."""
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _mesh_coords(tuple(shape[1:])):
            yield (i, *rest)


@contextmanager
def _quiet():
    """Silence DCP's single-process and DeviceMesh's unpickling warnings while reading."""
    logger = logging.getLogger("torch.distributed.device_mesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


class RenamedSource(TensorSource):
    """Another source's tensors under other names (``names``: new name -> the source's name)."""

    def __init__(self, source: TensorSource, names: dict[str, str]):
        self.source, self.names = source, names

    def keys(self) -> list[str]:
        return list(self.names)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.source.shape(self.names[key])

    def dtype(self, key: str) -> torch.dtype:
        return self.source.dtype(self.names[key])

    def get(self, key: str) -> torch.Tensor:
        return self.source.get(self.names[key])

    def where(self, key: str) -> str:
        return self.source.where(self.names[key])


def in_model_names(source: TensorSource, meta_dir: Path) -> TensorSource:
    """``source`` under the model's own state-dict names, where its files use an older layout transformers
    renames on load (a vision-language model from the hub: ``model.layers.*`` and ``visual.*`` are
    ``model.language_model.layers.*`` and ``model.visual.*`` in the model). Text models are left alone."""
    import json

    from rlctl.data.vision import is_vision_config

    if not is_vision_config(json.loads((meta_dir / "config.json").read_text())):
        return source
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from rlctl.data.vision import auto_model_class

    config = AutoConfig.from_pretrained(str(meta_dir))
    with torch.device("meta"):
        model = auto_model_class(config).from_config(config)
    conversions = get_model_conversion_mapping(model)
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    state = model.state_dict()
    names = {}
    for key in source.keys():
        new, _ = rename_source_key(key, renamings, converters, model.base_model_prefix, state)
        names[new if new in state else key] = key
    return source if all(k == v for k, v in names.items()) else RenamedSource(source, names)
