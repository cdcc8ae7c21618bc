"""Read FSDP training checkpoints key by key and turn them into Hugging Face models.

Two layouts are understood (see docs/convert.md):

* ``rlctl-dcp``: rlctl's ``checkpoints/step_N/`` (torch.distributed.checkpoint files whose model
  keys are ``model.<fqn>``, plus ``huggingface/``, ``trainer_state.json``, optional ``lora_adapter/``).
  Tensors are read one at a time with ``dcp.load`` into empty tensors, without a process group.
* ``verl-fsdp``: verl's ``global_step_N/actor/`` (``model_world_size_{W}_rank_{r}.pt`` holding each
  rank's DTensor shards, ``fsdp_config.json``, ``huggingface/``, optional ``lora_adapter/``). The
  rank files are opened with ``mmap=True`` and each key is assembled from its shards on its own,
  so memory stays near the largest tensor rather than the model size.

Every reader is a :class:`TensorSource` (``keys()``, ``shape()``, ``get()``); names are cleaned of
FSDP/compile wrapper prefixes, and peft names are resolved later by :mod:`rlctl.convert.lora`.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlctl.errors import UserError

RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    """Drop FSDP1 / activation-checkpointing / torch.compile wrapper segments from a parameter name."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


# ----------------------------------------------------------------------------- sources


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
        from safetensors import safe_open

        path = Path(path)
        files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
        if not files:
            raise UserError(f"{path}: no .safetensors weights found")
        self._safe_open = safe_open
        self._handles = {}
        for f in files:
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except Exception as e:  # noqa: BLE001 - a truncated or foreign file
                raise UserError(f"{f}: not a readable safetensors file ({e})") from None
        self._file: dict[str, Path] = {}
        for f, handle in self._handles.items():
            names = handle.keys()
            self._file.update(dict.fromkeys(names, f))

    def keys(self) -> list[str]:
        return list(self._file)

    def _slice(self, key: str):
        return self._handles[self._file[key]].get_slice(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        return _ST_DTYPES[self._slice(key).get_dtype()]

    def get(self, key: str) -> torch.Tensor:
        # a short-lived handle per read: the file's mapped pages do not pile up in memory
        with self._safe_open(str(self._file[key]), framework="pt") as handle:
            return handle.get_tensor(key)

    def where(self, key: str) -> str:
        return str(self._file[key])


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

    def __init__(self, path: Path, prefix: str = "model."):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.path = path
        self._reader = FileSystemReader(str(path))
        try:
            metadata = self._reader.read_metadata()
        except Exception as e:  # noqa: BLE001 - any unreadable metadata is the user's file
            raise UserError(f"{path / '.metadata'}: cannot read the DCP metadata ({e})") from None
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
            dcp.load({self._raw[key]: tensor}, storage_reader=self._reader, no_dist=True)
        return tensor

    def where(self, key: str) -> str:
        return str(self.path)


class VerlSource(TensorSource):
    """verl's per-rank ``model_world_size_{W}_rank_{r}.pt`` files (DTensor shards), memory-mapped."""

    def __init__(self, path: Path, world_size: int):
        from torch.distributed.tensor import DTensor

        self.path = path
        self.world_size = world_size
        self.files = [path / f"model_world_size_{world_size}_rank_{r}.pt" for r in range(world_size)]
        self._states = []
        with _quiet():
            for f in self.files:
                try:
                    state = torch.load(f, map_location="cpu", mmap=True, weights_only=False)
                except Exception as e:  # noqa: BLE001 - a corrupt or foreign file
                    raise UserError(f"{f}: cannot load the rank file ({type(e).__name__}: {e})") from None
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


# ----------------------------------------------------------------------------- locating checkpoints


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

    def open(self) -> TensorSource:
        if self.format == "rlctl-dcp":
            return DcpSource(self.weights_dir)
        return VerlSource(self.weights_dir, self.world_size or 0)

    def config(self) -> dict:
        return json.loads((self.meta_dir / "config.json").read_text())


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
        raise UserError(f"{path} does not exist")
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
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        return "already a Hugging Face model; nothing to convert"
    if (path / "rlctl_megatron.json").is_file() or (path / "metadata.json").is_file():
        return "a Megatron checkpoint; use `rlctl convert megatron-to-hf`"
    return (
        "unknown checkpoint format: expected an rlctl step dir (.metadata + huggingface/), a verl "
        "actor dir (model_world_size_W_rank_R.pt), or a run dir holding checkpoints/ or global_step_*/"
    )


_STEP_DIR = re.compile(r"^(?:step_|global_step_)(\d+)$")


def _latest_step(path: Path, notes: list[str]) -> Path:
    """Descend from a run dir or checkpoint root to its latest step dir; other paths are returned as is."""
    if is_dcp_dir(path) or rank_files(path) or rank_files(path / "actor"):
        return path
    if not path.is_dir():
        raise UserError(f"{path}: not a directory; pass a checkpoint directory")
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = {int(m.group(1)): d for d in root.iterdir() if d.is_dir() and (m := _STEP_DIR.match(d.name))}
    if not steps:
        return path
    chosen = None
    for marker in ("latest", "latest_checkpointed_iteration.txt"):
        if (root / marker).is_file():
            text = (root / marker).read_text().strip()
            for step, d in steps.items():
                if text in (d.name, str(step)):
                    chosen = d
    if chosen is None:
        chosen = steps[max(steps)]
    notes.append(f"using the latest checkpoint {chosen} ({len(steps)} step dir(s) in {root})")
    return chosen


def _step_of(path: Path) -> int | None:
    for part in (path.name, path.parent.name):
        m = _STEP_DIR.match(part)
        if m:
            return int(m.group(1))
    return None


def _require_meta(meta_dir: Path, ckpt: Path) -> Path:
    if not (meta_dir / "config.json").is_file():
        raise UserError(
            f"{ckpt}: no huggingface/config.json beside the weights; the checkpoint cannot describe its model"
        )
    return meta_dir


def _rlctl_checkpoint(path: Path, notes: list[str]) -> Checkpoint:
    step = _step_of(path)
    world = None
    state_file = path / "trainer_state.json"
    if state_file.is_file():
        try:
            state = json.loads(state_file.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{state_file}: not valid JSON ({e})") from None
        step = state.get("step", step)
        world = state.get("world_size")
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
        fsdp_config = json.loads(config_file.read_text())
        version = fsdp_config.get("FSDP_version")
        declared = fsdp_config.get("world_size")
        if declared is not None and int(declared) != world:
            raise UserError(f"{config_file}: world_size {declared} but the rank files are for world size {world}")
    else:
        notes.append(f"no fsdp_config.json; world size {world} taken from the rank file names")
    missing = [r for r in range(world) if r not in ranks]
    if missing:
        raise UserError(
            f"{path}: missing model_world_size_{world}_rank_{missing[0]}.pt ({len(missing)} of {world} rank files absent)"
        )
    adapter = path / "lora_adapter"
    return Checkpoint(
        format="verl-fsdp",
        weights_dir=path,
        meta_dir=_require_meta(path / "huggingface", path),
        step=_step_of(path),
        world_size=world,
        fsdp_version=version,
        adapter_dir=adapter if adapter.is_dir() else None,
        notes=notes,
    )


# ----------------------------------------------------------------------------- conversion


@dataclass
class ConvertResult:
    """What a conversion did (the CLI prints it)."""

    out_dir: Path
    committed: bool
    dtype: torch.dtype | None
    tensors: int
    folded: list[str] = field(default_factory=list)
    adapter_kept: bool = False
    unknown: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verdict: object | None = None  # rlctl.convert.verify.Verdict
    checkpoint: Checkpoint | None = None


def convert_source(
    source: TensorSource,
    out_dir: str | Path,
    *,
    meta_dir: Path,
    adapter_dir: Path | None,
    where: str,
    dtype: str | None = None,
    keep_adapter: bool = False,
    verify: bool = True,
    force: bool = False,
    progress: bool = False,
    max_shard_bytes: int = 5 * 2**30,
    notes: list[str] | None = None,
) -> ConvertResult:
    """Write the HF model of ``source`` to ``out_dir``: LoRA folded (or kept), shapes checked, verified.

    ``dtype`` None means the dtype config.json declares (the source's when it declares none).
    """
    import tempfile

    from rlctl.convert.lora import (
        LoraSpec,
        adapter_tensors,
        base_tensors,
        hf_layout,
        merged_tensors,
        peft_reference,
        write_adapter,
    )
    from rlctl.convert.verify import Architecture, verify_model, write_verified
    from rlctl.formats.hf_writer import check_out_dir, config_dtype, resolve_dtype

    out_dir = Path(out_dir).absolute()
    check_out_dir(out_dir, force)
    layout = hf_layout(source, adapter_dir, where)
    spec = None
    if layout.has_lora:
        if adapter_dir is None or not (adapter_dir / "adapter_config.json").is_file():
            raise UserError(
                f"{where}: LoRA weights but no lora_adapter/adapter_config.json to read the rank and alpha from"
            )
        spec = LoraSpec.from_dir(adapter_dir)
    elif keep_adapter:
        raise UserError(f"{where}: --keep-adapter given but the checkpoint holds no LoRA weights")
    arch = Architecture.from_dir(meta_dir)
    unknown = arch.check({name: layout.shape(source, name) for name in layout.base}, where)
    target = resolve_dtype(dtype) or config_dtype(json.loads((meta_dir / "config.json").read_text()))
    fold = layout.has_lora and not keep_adapter
    tensors = merged_tensors(source, layout, spec) if fold else base_tensors(source, layout)

    def add_adapter(tmp: Path) -> None:
        write_adapter(tmp / "adapter", layout, spec, target)

    def check(tmp: Path):
        if not layout.has_lora:
            return verify_model(tmp, base_tensors(source, layout), dtype=target)
        base = dict(base_tensors(source, layout))
        with tempfile.TemporaryDirectory() as scratch:
            peft_dir = adapter_dir
            if layout.lora_source is source or not (adapter_dir / "adapter_model.safetensors").is_file():
                peft_dir = Path(scratch)
                write_adapter(peft_dir, layout, spec)
            reference = peft_reference(meta_dir, base, peft_dir)
        if keep_adapter:
            return verify_model(tmp, base.items(), dtype=target, adapter=adapter_tensors(layout), reference=reference)
        expected = {name: reference.get(name, tensor) for name, tensor in base.items()}
        return verify_model(tmp, expected.items(), dtype=target, rounding=True)

    written = write_verified(
        out_dir,
        tensors,
        meta_dir=meta_dir,
        dtype=target,
        force=force,
        verify=check if verify else None,
        before_verify=add_adapter if keep_adapter else None,
        total=len(layout.base),
        progress=progress,
        max_shard_bytes=max_shard_bytes,
    )
    return ConvertResult(
        out_dir=out_dir,
        committed=written.committed,
        dtype=target,
        tensors=len(layout.base),
        folded=sorted(layout.lora) if fold else [],
        adapter_kept=keep_adapter,
        unknown=unknown,
        notes=list(notes or []),
        verdict=written.verdict,
    )


def fsdp_to_hf(path: str | Path, out_dir: str | Path, **options) -> ConvertResult:
    """Convert an rlctl DCP or verl FSDP checkpoint (step, actor or run dir) to an HF model.

    ``options``: those of :func:`convert_source` (dtype, keep_adapter, verify, force, progress, ...).
    """
    ckpt = locate_checkpoint(path)
    result = convert_source(
        ckpt.open(),
        out_dir,
        meta_dir=ckpt.meta_dir,
        adapter_dir=ckpt.adapter_dir,
        where=str(ckpt.weights_dir),
        notes=ckpt.notes,
        **options,
    )
    result.checkpoint = ckpt
    return result
