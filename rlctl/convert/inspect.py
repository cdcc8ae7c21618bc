"""Describe a checkpoint without converting it: format, parallel layout, dtype, size, step, LoRA.

Reads only metadata (DCP metadata, DTensor headers of memory-mapped rank files, safetensors
headers, JSON files), so it is quick even for large checkpoints.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch

from rlctl.convert.locate import describe_unknown, is_dcp_dir, locate_checkpoint, rank_files
from rlctl.convert.lora import LoraSpec, split_peft_keys
from rlctl.convert.sources import SafetensorsSource, TensorSource
from rlctl.errors import UserError
from rlctl.formats.hf_writer import config_dtype, config_ties_embeddings, dtype_name
from rlctl.formats.safetensors import read_hf_config

# What reading each format unpickles (see docs/security.md): shown by `rlctl convert inspect`.
UNPICKLING = {
    "rlctl-dcp": "restricted: .metadata admits only DCP metadata classes; tensors weights_only",
    "verl-fsdp": "restricted: rank files loaded weights_only (tensors, DTensor, mesh, placements)",
    "hf": "none (safetensors and JSON only)",
    "peft-adapter": "none (safetensors and JSON only)",
    "megatron (rlctl-shards)": "none (safetensors and JSON only)",
    "megatron (torch_dist)": "restricted: .metadata admits only DCP metadata classes; tensors weights_only; "
    "common.pt (a full pickle, cannot be restricted) is never read",
}
TRUSTED = "FULL (--trust-checkpoint): the checkpoint's pickles may run code"


def inspect_checkpoint(path: str | Path, *, trust: bool = False) -> dict:
    """A JSON-ready description of the checkpoint at ``path`` (see :func:`render`).

    ``trust``: unpickle the checkpoint's files fully (see docs/security.md).
    """
    info = _inspect(Path(path), trust)
    pickled = info.get("format") in ("rlctl-dcp", "verl-fsdp", "megatron (torch_dist)")
    info["unpickling"] = TRUSTED if trust and pickled else UNPICKLING.get(info.get("format"), "none")
    return info


def _inspect(path: Path, trust: bool) -> dict:
    path = Path(path)
    if not path.exists():
        raise UserError(f"{path} does not exist")
    if (path / "adapter_config.json").is_file():
        return _inspect_adapter(path)
    megatron = _megatron_format(path)
    if megatron is not None:
        return _inspect_megatron(path, megatron)
    if (
        (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
        and not is_dcp_dir(path)
        and not rank_files(path)
    ):
        return _inspect_hf(path)
    try:
        ckpt = locate_checkpoint(path)
    except UserError:
        raise UserError(f"{path}: {describe_unknown(path)}") from None
    source = ckpt.open(trust=trust)
    config = ckpt.config()
    info = {
        "format": ckpt.format,
        "path": str(ckpt.weights_dir),
        "step": ckpt.step,
        "world_size": ckpt.world_size,
        "model_type": config.get("model_type"),
        "config_dtype": _name(config_dtype(config)),
        "notes": ckpt.notes,
    }
    if ckpt.fsdp_version is not None:
        info["fsdp_version"] = ckpt.fsdp_version
    if ckpt.format == "verl-fsdp":
        info["mesh"] = source.mesh()
    info.update(_tensor_stats(source, config, str(ckpt.weights_dir)))
    info["lora"] = _lora_info(source, ckpt.adapter_dir, str(ckpt.weights_dir))
    return info


def _name(dtype: torch.dtype | None) -> str | None:
    return dtype_name(dtype) if dtype is not None else None


def _tensor_stats(source: TensorSource, config: dict, where: str) -> dict:
    """Parameter count (tied embeddings once, LoRA apart) and the dominant weight dtype."""
    base, lora = split_peft_keys(source.keys(), where)
    tied = config_ties_embeddings(config)
    params = 0
    dtypes: Counter[str] = Counter()
    for name, key in base.items():
        if tied and name == "lm_head.weight" and "model.embed_tokens.weight" in base:
            continue
        n = _numel(source.shape(key))
        params += n
        dtypes[dtype_name(source.dtype(key))] += n
    lora_params = sum(_numel(source.shape(k)) for pair in lora.values() for k in (pair.a_key, pair.b_key))
    out = {"params": params, "dtype": dtypes.most_common(1)[0][0] if dtypes else None, "tensors": len(base)}
    if lora_params:
        out["lora_params"] = lora_params
    return out


def _lora_info(source: TensorSource, adapter_dir: Path | None, where: str) -> dict | None:
    _, lora = split_peft_keys(source.keys(), where)
    weights_in = "checkpoint"
    weights_file = adapter_dir / "adapter_model.safetensors" if adapter_dir else None
    if not lora and weights_file is not None and weights_file.is_file():
        _, lora = split_peft_keys(SafetensorsSource(weights_file).keys(), str(weights_file))
        weights_in = "lora_adapter/"
    if not lora:
        return None
    info: dict = {"modules": len(lora), "weights_in": weights_in}
    if adapter_dir is not None and (adapter_dir / "adapter_config.json").is_file():
        spec = LoraSpec.from_dir(adapter_dir)
        info.update(
            r=spec.r, alpha=spec.alpha, use_rslora=spec.use_rslora, target_modules=spec.raw.get("target_modules")
        )
        if spec.rank_pattern or spec.alpha_pattern:
            info.update(rank_pattern=spec.rank_pattern, alpha_pattern=spec.alpha_pattern)
    else:
        info["config"] = "missing (no lora_adapter/adapter_config.json)"
    return info


def _inspect_hf(path: Path) -> dict:
    config = read_hf_config(path)
    source = SafetensorsSource(path)
    info = {
        "format": "hf",
        "path": str(path),
        "model_type": config.get("model_type"),
        "config_dtype": _name(config_dtype(config)),
    }
    info.update(_tensor_stats(source, config, str(path)))
    return info


def _inspect_adapter(path: Path) -> dict:
    spec = LoraSpec.from_dir(path)
    info = {
        "format": "peft-adapter",
        "path": str(path),
        "base_model": spec.raw.get("base_model_name_or_path"),
        "lora": {
            "r": spec.r,
            "alpha": spec.alpha,
            "use_rslora": spec.use_rslora,
            "target_modules": spec.raw.get("target_modules"),
        },
    }
    weights = path / "adapter_model.safetensors"
    if weights.is_file():
        source = SafetensorsSource(weights)
        _, lora = split_peft_keys(source.keys(), str(weights))
        info["lora"]["modules"] = len(lora)
        names = source.keys()
        info["params"] = sum(_numel(source.shape(k)) for k in names)
        info["dtype"] = dtype_name(source.dtype(names[0])) if names else None
    return info


def _megatron_format(path: Path) -> str | None:
    from rlctl.convert import megatron_io

    for candidate in (path, path / "dist_ckpt"):
        fmt = megatron_io.detect_megatron_format(candidate)
        if fmt:
            return fmt
    return None


def _inspect_megatron(path: Path, fmt: str) -> dict:
    from rlctl.convert import megatron_io

    info: dict = {"format": f"megatron ({fmt})", "path": str(path)}
    meta_file = path / megatron_io.META_FILE
    if meta_file.is_file():
        meta = read_hf_config(meta_file)
        config = meta.get("hf_config") or {}
        info.update(
            tp=meta.get("tp"),
            pp=meta.get("pp"),
            model_type=config.get("model_type"),
            config_dtype=_name(config_dtype(config)),
        )
        shard = next(path.glob("mp_rank_*/model.safetensors"), None)
        if shard is not None:
            source = SafetensorsSource(shard)
            names = source.keys()
            info["dtype"] = Counter(dtype_name(source.dtype(k)) for k in names).most_common(1)[0][0]
        info["params"] = _config_params(config)
    return info


def _config_params(config: dict) -> int | None:
    """Exact parameter count of the architecture a config.json dict describes (tied weights once)."""
    from transformers import AutoConfig

    from rlctl.data.vision import auto_model_class

    try:
        cfg = AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = auto_model_class(cfg).from_config(cfg)
    except Exception:  # noqa: BLE001 - unknown architecture: no count
        return None
    return sum(p.numel() for p in model.parameters())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def render(info: dict):
    """A rich table of an :func:`inspect_checkpoint` result."""
    from rich.table import Table

    table = Table(title=f"checkpoint: {info.get('path')}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in info.items():
        if key in ("path",) or value is None or value == []:
            continue
        if key in ("params", "lora_params") and isinstance(value, int):
            value = f"{value:,} ({value / 1e9:.3g} B)" if value >= 1e8 else f"{value:,}"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, list):
            value = "; ".join(str(v) for v in value)
        table.add_row(key.replace("_", " "), str(value))
    if info.get("lora") is None and info.get("format") in ("rlctl-dcp", "verl-fsdp"):
        table.add_row("lora", "no")
    return table
