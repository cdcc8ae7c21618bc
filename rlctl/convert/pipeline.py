"""The conversion pipeline: tensor source -> LoRA fold (or kept adapter) -> shape check -> verify -> atomic write.

:func:`convert_source` is the one path every FSDP / LoRA conversion takes; :func:`fsdp_to_hf` (an
rlctl DCP or verl checkpoint, located by :mod:`rlctl.convert.locate`) and :func:`lora_merge` (an HF
base model + a peft adapter) feed it. The output is written under a temporary name and renamed when
verified; it may never be, contain or sit inside an input (convert never destroys its input).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlctl.convert import lora
from rlctl.convert.locate import Checkpoint, locate_checkpoint
from rlctl.convert.sources import SafetensorsSource, TensorSource, in_model_names
from rlctl.convert.verify import Architecture, verify_model, write_verified
from rlctl.errors import UserError
from rlctl.formats.hf_writer import check_out_dir, config_dtype, resolve_dtype
from rlctl.formats.safetensors import read_hf_config


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
    inputs: Sequence[Path] = (),
) -> ConvertResult:
    """Write the HF model of ``source`` to ``out_dir``: LoRA folded (or kept), shapes checked, verified.

    ``dtype`` None means the dtype config.json declares (the source's when it declares none).
    ``inputs``: directories the conversion reads besides ``meta_dir`` and ``adapter_dir``; ``out_dir``
    may be none of them, nor inside or around one (convert never writes over its input).
    """
    out_dir = Path(out_dir).absolute()
    check_out_dir(out_dir, force, inputs=[meta_dir, *([adapter_dir] if adapter_dir else []), *inputs])
    layout = lora.hf_layout(source, adapter_dir, where)
    spec = _lora_spec(layout, adapter_dir, keep_adapter=keep_adapter, where=where)
    arch = Architecture.from_dir(meta_dir)
    unknown = arch.check({name: layout.shape(source, name) for name in layout.base}, where)
    target = resolve_dtype(dtype) or config_dtype(read_hf_config(meta_dir))
    fold = layout.has_lora and not keep_adapter
    tensors = lora.merged_tensors(source, layout, spec) if fold else lora.base_tensors(source, layout)

    add_adapter = functools.partial(_write_adapter, layout=layout, spec=spec, dtype=target)  # add_adapter(tmp)
    kw = dict(source=source, layout=layout, spec=spec, meta_dir=meta_dir, adapter_dir=adapter_dir)
    check = functools.partial(_verify, **kw, keep_adapter=keep_adapter, dtype=target)  # check(tmp): its verdict
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


def _write_adapter(tmp: Path, *, layout, spec, dtype) -> None:
    """A kept LoRA adapter, written beside the model (in ``tmp/adapter``) before the model is verified."""
    lora.write_adapter(tmp / "adapter", layout, spec, dtype)


def _lora_spec(layout, adapter_dir: Path | None, *, keep_adapter: bool, where: str):
    """The rank and alpha of the checkpoint's LoRA weights (None: it holds none)."""
    if not layout.has_lora:
        if keep_adapter:
            raise UserError(f"{where}: --keep-adapter given but the checkpoint holds no LoRA weights")
        return None
    if adapter_dir is None or not (adapter_dir / "adapter_config.json").is_file():
        raise UserError(
            f"{where}: LoRA weights but no lora_adapter/adapter_config.json to read the rank and alpha from"
        )
    return lora.LoraSpec.from_dir(adapter_dir)


def _verify(tmp: Path, source, layout, spec, meta_dir: Path, adapter_dir, *, keep_adapter: bool, dtype):
    """The written model against the source: the base tensors, or with LoRA what PEFT computes (folded
    weights, or the kept adapter beside the base)."""
    if not layout.has_lora:
        return verify_model(tmp, lora.base_tensors(source, layout), dtype=dtype)
    base = dict(lora.base_tensors(source, layout))
    with tempfile.TemporaryDirectory() as scratch:
        peft_dir = adapter_dir
        if layout.lora_source is source or not (adapter_dir / "adapter_model.safetensors").is_file():
            peft_dir = Path(scratch)
            lora.write_adapter(peft_dir, layout, spec)
        reference = lora.peft_reference(meta_dir, base, peft_dir)
    if keep_adapter:
        return verify_model(tmp, base.items(), dtype=dtype, adapter=lora.adapter_tensors(layout), reference=reference)
    expected = {name: reference.get(name, tensor) for name, tensor in base.items()}
    return verify_model(tmp, expected.items(), dtype=dtype, rounding=True)


def fsdp_to_hf(path: str | Path, out_dir: str | Path, *, trust: bool = False, **options) -> ConvertResult:
    """Convert an rlctl DCP or verl FSDP checkpoint (step, actor or run dir) to an HF model.

    ``trust``: unpickle the checkpoint's files fully (they may run code; see docs/security.md).
    ``options``: those of :func:`convert_source` (dtype, keep_adapter, verify, force, progress, ...).
    """
    ckpt = locate_checkpoint(path)
    check_out_dir(Path(out_dir).absolute(), options.get("force", False), inputs=[ckpt.weights_dir, ckpt.meta_dir])
    result = convert_source(
        ckpt.open(trust=trust),
        out_dir,
        inputs=[ckpt.weights_dir],
        meta_dir=ckpt.meta_dir,
        adapter_dir=ckpt.adapter_dir,
        where=str(ckpt.weights_dir),
        notes=ckpt.notes,
        **options,
    )
    result.checkpoint = ckpt
    return result


def lora_merge(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, **options):
    """Fold a peft adapter into an HF base model (safetensors) and write the merged HF model.

    ``options``: those of :func:`convert_source` (dtype, verify, force, progress).
    """
    base_dir, adapter_dir = Path(base_dir), Path(adapter_dir)
    check_out_dir(Path(out_dir).absolute(), options.get("force", False), inputs=[base_dir, adapter_dir])
    if not (base_dir / "config.json").is_file():
        raise UserError(f"{base_dir}: not a Hugging Face model directory (no config.json)")
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        if not (adapter_dir / name).is_file():
            raise UserError(f"{adapter_dir / name}: not found (no {name}); expected a peft adapter directory")
    lora.LoraSpec.from_dir(adapter_dir)  # refuse DoRA and non-LoRA adapters before reading weights
    weights = adapter_dir / "adapter_model.safetensors"
    if not lora.split_peft_keys(SafetensorsSource(weights).keys(), str(weights))[1]:
        raise UserError(f"{weights}: the adapter holds no LoRA weights")
    source = in_model_names(SafetensorsSource(base_dir), base_dir)  # a hub VL model's older names, as loaded
    return convert_source(source, out_dir, meta_dir=base_dir, adapter_dir=adapter_dir, where=str(base_dir), **options)
