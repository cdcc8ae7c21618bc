"""The small training-engine interface the recipes use, and where a model's files come from.

An engine owns one model (actor, reference or critic) sharded over the data-parallel ranks,
its optimizer and its learning-rate schedule. The recipes (sft, grpo, ppo) only talk to this
interface, so the FSDP2 engine (:mod:`rlctl.engines.fsdp`) and a Megatron engine can be swapped.

Contract of a training step, for every engine::

    for i, mb in enumerate(micro_batches):            # the same count on every rank
        out = engine.forward(mb.input_ids, mb.position_ids, mb.attention_mask)
        loss = <this rank's share of the global loss>  # the ranks' shares SUM to the global loss
        engine.backward(loss, sync=(i == last))
    grad_norm = engine.step()                          # clip, optimizer step, lr schedule, zero grads

Gradients are summed over ranks (not averaged), so a loss normalised by the global number of
loss tokens gives the same update for any world size or number of micro-batches.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rlctl.errors import UserError

ROLES = ("actor", "ref", "critic")


class TrainEngine(abc.ABC):
    """A (possibly sharded) model with its optimizer; see the module docstring for the step contract."""

    role: str
    model: torch.nn.Module
    device: torch.device
    hf_config: object  # the transformers config of the underlying model

    @abc.abstractmethod
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] (actor/ref) or values [B, T] (critic). Packed rows: attention_mask None."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, *, sync: bool = True) -> None:
        """Accumulate gradients of this rank's share of the loss; ``sync`` on the last micro-batch."""

    @abc.abstractmethod
    def step(self) -> float:
        """Clip gradients, step the optimizer and the schedule, zero gradients; return the total grad norm."""

    @property
    @abc.abstractmethod
    def lr(self) -> float:
        """The learning rate the next :meth:`step` uses."""

    @abc.abstractmethod
    def train(self, mode: bool = True) -> None:
        """Switch dropout etc. on (train) or off (eval)."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """A distributed-checkpoint state: {"model", "optim", "scheduler"} (only "model" when frozen)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (after ``dcp.load`` filled it in)."""

    @abc.abstractmethod
    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) one at a time on EVERY rank (collective; LoRA merged)."""

    @abc.abstractmethod
    def export_hf(self, out_dir: str | Path, meta_dir: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Write the full model as a Hugging Face directory (collective; rank 0 writes)."""

    def lora_info(self) -> dict | None:
        """The LoRA settings (peft's adapter config as a dict), or None for full fine-tuning."""
        return None

    def save_lora_config(self, out_dir: str | Path) -> None:
        """Write peft's adapter_config.json into ``out_dir`` (LoRA only)."""


# ---------------------------------------------------------------------------------------------
# Where the model's files come from


@dataclass(frozen=True)
class ModelSource:
    """A model to load: a local directory or a hub id, or only a config for random weights."""

    path: str  # local directory or HF id (from_pretrained accepts both)
    random_init: bool  # build from the config with random weights instead of loading weights
    config_dict: dict | None = None  # set when the config comes from the catalog (random_init, no files)

    def load_config(self):
        from transformers import AutoConfig, PretrainedConfig

        if self.config_dict is not None:
            d = dict(self.config_dict)
            return AutoConfig.for_model(d.pop("model_type"), **d) if "model_type" in d else PretrainedConfig(**d)
        try:
            return AutoConfig.from_pretrained(self.path)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the model config of '{self.path}': {str(e).splitlines()[0]}") from None


def model_source(name: str, *, random_init: bool = False) -> ModelSource:
    """Resolve ``model.name``: a local HF directory (or its config.json), else a catalog name / HF id."""
    if not name:
        raise UserError("no model given: pass --model (a catalog name, HF id or local directory)")
    p = Path(name).expanduser()
    if p.is_file() and p.name == "config.json":
        p = p.parent
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(f"{p} has no config.json; pass a Hugging Face model directory")
        return ModelSource(str(p), random_init)
    from rlctl.catalog import hf_config_dict, resolve_model

    spec = resolve_model(name)
    # A hub id as written keeps its variant (the catalog maps Qwen/Qwen2.5-7B-Instruct to the base entry).
    path = name if "/" in name else spec.hf_id
    return ModelSource(path, random_init, hf_config_dict(spec) if random_init else None)


def load_tokenizer(source: ModelSource):
    """The tokenizer beside the model (fast tokenizers give offsets for exact loss masks)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from '{source.path}': {str(e).splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def write_model_meta(out_dir: str | Path, hf_config, tokenizer, source: ModelSource) -> Path:
    """Write config.json, generation_config.json and the tokenizer files: what makes a checkpoint self-describing."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    try:
        gen = GenerationConfig.from_pretrained(source.path)
    except (OSError, ValueError):
        gen = GenerationConfig.from_model_config(hf_config)
    gen.save_pretrained(str(out))
    return out


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
