"""LoRA: resolve peft names, fold adapters into base weights, or write them out as a peft adapter.

A folded weight is ``W + scale * B @ A`` (transposed for embeddings and ``fan_in_fan_out``) with
``scale = alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA; ``r`` and ``alpha`` come from the
adapter's own config, per module when ``rank_pattern`` / ``alpha_pattern`` match (peft's rule: the
pattern matches the end of the module name at a dot boundary). The fold is computed in fp32.

Names: ``base_model.model.`` is dropped, ``.base_layer`` removed, ``lora_A/B[.adapter].weight`` and
``lora_embedding_A/B[.adapter]`` recognised, and a ``modules_to_save`` copy replaces its
``original_module``. DoRA and several adapters in one checkpoint are refused.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlctl.convert.sources import SafetensorsSource, TensorSource
from rlctl.errors import UserError

PEFT_PREFIX = "base_model.model."
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<embedding>embedding_)?(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?$")


@dataclass
class LoraSpec:
    """The scaling-relevant part of a peft LoraConfig (adapter_config.json)."""

    r: int
    alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    fan_in_fan_out: bool = False
    raw: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict, where: str = "adapter_config.json") -> LoraSpec:
        if d.get("peft_type", "LORA") != "LORA":
            raise UserError(f"{where}: peft_type {d.get('peft_type')} is not LoRA; only LoRA adapters can be merged")
        if d.get("use_dora"):
            raise UserError(
                f"{where}: DoRA adapters (use_dora) are not supported; merge them with peft's merge_and_unload"
            )
        if "r" not in d:
            raise UserError(f"{where}: no rank 'r' in the adapter config")
        return cls(
            r=int(d["r"]),
            alpha=float(d.get("lora_alpha", d["r"])),
            use_rslora=bool(d.get("use_rslora", False)),
            rank_pattern=dict(d.get("rank_pattern") or {}),
            alpha_pattern=dict(d.get("alpha_pattern") or {}),
            fan_in_fan_out=bool(d.get("fan_in_fan_out", False)),
            raw=d,
        )

    @classmethod
    def from_dir(cls, adapter_dir: Path) -> LoraSpec:
        file = adapter_dir / "adapter_config.json"
        if not file.is_file():
            raise UserError(f"{adapter_dir}: no adapter_config.json")
        try:
            return cls.from_dict(json.loads(file.read_text()), str(file))
        except json.JSONDecodeError as e:
            raise UserError(f"{file}: not valid JSON ({e})") from None

    def rank(self, module: str) -> int:
        key = _pattern_key(self.rank_pattern, module)
        return int(self.rank_pattern[key]) if key else self.r

    def alpha_of(self, module: str) -> float:
        key = _pattern_key(self.alpha_pattern, module)
        return float(self.alpha_pattern[key]) if key else self.alpha

    def scale(self, module: str) -> float:
        r = self.rank(module)
        return self.alpha_of(module) / (math.sqrt(r) if self.use_rslora else r)


def _pattern_key(patterns: dict, module: str) -> str | None:
    """peft's matching: the pattern equals the end of the module name, at a dot boundary."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


@dataclass
class LoraPair:
    a_key: str | None = None
    b_key: str | None = None
    embedding: bool = False


@dataclass
class HFLayout:
    """How the HF tensors come out of a source: base names -> source keys, and the LoRA pairs."""

    base: dict[str, str]  # hf name -> source key (insertion order = checkpoint order)
    lora: dict[str, LoraPair]  # module name (hf, no prefix) -> keys in lora_source
    lora_source: TensorSource | None = None
    overrides: dict[str, str] = field(default_factory=dict)  # hf name -> full weight in lora_source

    @property
    def has_lora(self) -> bool:
        return bool(self.lora)

    def shape(self, source: TensorSource, name: str) -> tuple[int, ...]:
        if name in self.overrides:
            return self.lora_source.shape(self.overrides[name])
        return source.shape(self.base[name])

    def base_tensor(self, source: TensorSource, name: str) -> torch.Tensor:
        """The unmerged weight: the adapter's full copy (saved embeddings, modules_to_save) wins."""
        if name in self.overrides:
            return self.lora_source.get(self.overrides[name])
        return source.get(self.base[name])


def split_peft_keys(keys: list[str], where: str) -> tuple[dict[str, str], dict[str, LoraPair]]:
    """Map raw (possibly peft) keys to HF base names and LoRA pairs."""
    base: dict[str, str] = {}
    lora: dict[str, LoraPair] = {}
    adapters: set[str] = set()
    saved = {k for k in keys if ".modules_to_save." in k}
    for key in keys:
        name = key.removeprefix(PEFT_PREFIX)
        if "lora_magnitude_vector" in name:
            raise UserError(f"{where}: {key} is a DoRA magnitude; DoRA checkpoints are not supported")
        m = _LORA.match(name.removesuffix(".weight"))
        if m and (name.endswith(".weight") or m.group("embedding")):
            if m.group("adapter"):
                adapters.add(m.group("adapter"))
            pair = lora.setdefault(m.group("module"), LoraPair(embedding=bool(m.group("embedding"))))
            setattr(pair, "a_key" if m.group("ab") == "A" else "b_key", key)
            continue
        if ".original_module." in name and saved:
            continue
        name = re.sub(r"\.modules_to_save(?:\.[^.]+)?\.", ".", name)
        name = name.replace(".base_layer.", ".")
        if name in base:
            raise UserError(f"{where}: two tensors map to {name} ({base[name]} and {key})")
        base[name] = key
    if len(adapters) > 1:
        raise UserError(
            f"{where}: several LoRA adapters ({', '.join(sorted(adapters))}); merge one at a time with peft"
        )
    for module, pair in lora.items():
        if pair.a_key is None or pair.b_key is None:
            raise UserError(f"{where}: LoRA of {module} has only one of lora_A / lora_B")
    return base, lora


def hf_layout(source: TensorSource, adapter_dir: Path | None, where: str) -> HFLayout:
    """The HF view of a checkpoint: LoRA from its own keys, else from ``adapter_dir`` weights."""
    base, lora = split_peft_keys(source.keys(), where)
    if lora:
        return HFLayout(base, lora, source)
    weights = adapter_dir / "adapter_model.safetensors" if adapter_dir else None
    if weights is not None and weights.is_file():
        adapter = SafetensorsSource(weights)
        # full tensors in an adapter (saved embedding layers, modules_to_save) replace the base's
        overrides, lora = split_peft_keys(adapter.keys(), str(weights))
        missing = [f"{m}.weight" for m in lora if f"{m}.weight" not in base]
        missing += [name for name in overrides if name not in base]
        if missing:
            raise UserError(f"{weights}: the adapter has {missing[0]} but the base model has no such weight")
        return HFLayout(base, lora, adapter, overrides)
    return HFLayout(base, {})


def delta(spec: LoraSpec, module: str, a: torch.Tensor, b: torch.Tensor, embedding: bool) -> torch.Tensor:
    """``scale * B @ A`` in fp32, oriented like the base weight."""
    r = spec.rank(module)
    if a.shape[0] != r:
        raise UserError(f"LoRA rank of {module} is {a.shape[0]} but the adapter config says {r}")
    d = (b.float() @ a.float()) * spec.scale(module)
    return d.T if (embedding or spec.fan_in_fan_out) else d


def merged_tensors(source: TensorSource, layout: HFLayout, spec: LoraSpec | None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors with every LoRA pair folded into its base weight (fp32 where folded)."""
    folded = {f"{module}.weight": module for module in layout.lora}
    for name, key in layout.base.items():
        tensor = layout.base_tensor(source, name)
        module = folded.get(name)
        if module is not None:
            pair = layout.lora[module]
            lsrc = layout.lora_source
            d = delta(spec, module, lsrc.get(pair.a_key), lsrc.get(pair.b_key), pair.embedding)
            if d.shape != tensor.shape:
                raise UserError(
                    f"{source.where(key)}: LoRA delta of {module} has shape {list(d.shape)}, "
                    f"weight {list(tensor.shape)}"
                )
            tensor = tensor.float() + d
        yield name, tensor


def base_tensors(source: TensorSource, layout: HFLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """HF base tensors, LoRA left unmerged (full tensors the adapter carries applied)."""
    for name in layout.base:
        yield name, layout.base_tensor(source, name)


def adapter_tensors(layout: HFLayout) -> dict[str, torch.Tensor]:
    """The LoRA tensors under peft's saved names (``base_model.model.<module>.lora_A.weight``)."""
    out = {}
    for module, pair in layout.lora.items():
        a, b = ("lora_embedding_A", "lora_embedding_B") if pair.embedding else ("lora_A.weight", "lora_B.weight")
        out[f"{PEFT_PREFIX}{module}.{a}"] = layout.lora_source.get(pair.a_key).contiguous()
        out[f"{PEFT_PREFIX}{module}.{b}"] = layout.lora_source.get(pair.b_key).contiguous()
    return out


def write_adapter(dest: Path, layout: HFLayout, spec: LoraSpec, dtype: torch.dtype | None = None) -> None:
    """Write a peft adapter (adapter_model.safetensors + adapter_config.json) to ``dest``."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    tensors = adapter_tensors(layout)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
    (dest / "adapter_config.json").write_text(json.dumps(spec.raw, indent=2, sort_keys=True) + "\n")


def peft_reference(meta_dir: Path, base: dict[str, torch.Tensor], adapter_dir: Path) -> dict[str, torch.Tensor]:
    """peft's own merge (merge_and_unload, fp32) of ``base`` with the adapter in ``adapter_dir``.

    An independent computation of what folding must give, used by verification.
    """
    from peft import PeftModel
    from transformers import AutoConfig

    from rlctl.convert.verify import model_from_state

    config = AutoConfig.from_pretrained(str(meta_dir))
    # copies: merge_and_unload works in place and must not touch the caller's tensors
    model = model_from_state(
        config, {k: v.to(torch.float32, copy=True) if v.is_floating_point() else v.clone() for k, v in base.items()}
    )
    peft_model = PeftModel.from_pretrained(model, str(adapter_dir), torch_device="cpu")
    merged = peft_model.merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}
