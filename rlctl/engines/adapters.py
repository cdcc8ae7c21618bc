"""What kind of model an FSDP engine holds, chosen once: a :class:`ModelAdapter`.

An adapter owns what differs between a causal LM (actor, reference: :class:`ModelAdapter` itself), a PPO
critic (:class:`rlctl.engines.modules.CriticAdapter`: a backbone plus a value head) and a vision-language
model (:class:`rlctl.engines.vision.VisionAdapter`): building the module (the transformers class, what is
frozen, where LoRA goes), calling it (logits at the positions a micro-batch asks for, or values), and the
names of its parameters (Hugging Face names for export). The engine (:mod:`rlctl.engines.fsdp`) and the
builder (:func:`rlctl.engines.sharding.build_sharded_model`) never ask which kind they hold.

How the engine calls its model is the other choice made once: :class:`PlainCalls` (every rank its whole
sequences; packed rows attend per document through :mod:`rlctl.engines.varlen`) or, with sp > 1,
:class:`rlctl.engines.ulysses.UlyssesCalls`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from rlctl.engines import ulysses, varlen
from rlctl.engines.spec import LoraSpec
from rlctl.errors import UserError


@dataclass(frozen=True)
class CallContext:
    """What a forward needs from the engine: where it runs and how."""

    device: torch.device
    varlen: bool  # packed and shared-prefix rows attend per block through rlctl.engines.varlen
    gather_everywhere: bool  # sharded over several ranks: every rank runs every FSDP unit in every forward
    memory: Callable[[], contextlib.AbstractContextManager]  # host activations, autocast (the engine's)


class ModelAdapter:
    """A causal LM (actor or reference): transformers' ``AutoModelForCausalLM``; its output is logits."""

    kind = "causal LM"

    # ------------------------------------------------------------------ building

    def auto_class(self):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM

    def new_model(self, config, *, source, attn: str, dtype: torch.dtype, pretrained: bool) -> nn.Module:
        """The bare architecture (meta) or the real weights (``pretrained``: rank 0), before LoRA."""
        cls = self.auto_class()
        kwargs = {"attn_implementation": attn, "dtype": dtype}
        if pretrained and not source.random_init:
            try:  # the checkpoint's own dtype: half the host memory for bf16 weights; copies upcast exactly
                return cls.from_pretrained(source.path, config=config, **{**kwargs, "dtype": "auto"})
            except (OSError, ValueError) as e:
                raise UserError(f"cannot load the weights of '{source.path}': {str(e).splitlines()[0]}") from None
        return cls.from_config(config, **kwargs)

    def finish(self, model: nn.Module, config, *, train_vision: bool, param_dtype, pretrained: bool) -> nn.Module:
        """The built model with what this kind adds or freezes (nothing for a causal LM)."""
        return model

    def lora_host(self, model: nn.Module) -> nn.Module:
        """The module peft wraps (and, after, holds the adapters)."""
        return model

    def lora_targets(self, model: nn.Module, lora: LoraSpec, *, train_vision: bool):
        return lora.target_modules

    def with_lora(self, model: nn.Module, peft_model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """(the FSDP root that runs forward, the module checkpointed). The inner HF model is the root, not
        peft's wrapper, so ``generate`` keeps working."""
        return peft_model.base_model.model, peft_model

    def hf_model(self, root: nn.Module) -> nn.Module:
        """The transformers model inside the root, without peft's wrapper."""
        from peft import PeftModel

        hf = self.lora_host(root)
        return hf.base_model.model if isinstance(hf, PeftModel) else hf

    def tower(self, hf: nn.Module) -> nn.Module | None:
        """A module sharded as one FSDP unit of its own ahead of the decoder layers (a VL model's vision tower)."""
        return None

    # ------------------------------------------------------------------ calling

    def varlen(self, attn: str) -> bool:
        """Whether packed rows attend per document through :mod:`rlctl.engines.varlen`."""
        return attn == "sdpa"

    def shares_prefix(self, *, varlen: bool, attn: str) -> bool:
        """Whether shared-prefix micro-batches run (see :attr:`rlctl.engines.fsdp.FSDPEngine.shares_prefix`)."""
        return varlen

    def call(self, root: nn.Module, input_ids, position_ids, **kwargs) -> torch.Tensor:
        return root(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).logits

    def forward(self, root, input_ids, position_ids, attention_mask, ctx: CallContext) -> torch.Tensor:
        """Logits (values) of whole rows; padded rows pass their ``attention_mask``."""
        with ctx.memory():
            return self.call(root, input_ids, position_ids, attention_mask=attention_mask)

    def forward_micro(self, root, mb, ctx: CallContext) -> torch.Tensor:
        """One micro-batch's output, with as little wasted work as the layout allows: packed rows (and
        shared-prefix rows) attend per document (:mod:`rlctl.engines.varlen`, with sdpa)."""
        blocks, mask = mb.blocks, mb.attention_mask
        kwargs = {"attention_mask": mask}
        if blocks is not None:  # shared-prefix rows: a call per block, or one masked call (short rows, eager)
            kwargs = varlen.attention_kwargs(blocks, mb.input_ids, split=ctx.varlen)
        elif mask is None and ctx.varlen:  # packed rows: one call per document
            blocks = varlen.blocks_from_positions(mb.position_ids)
            if varlen.worth_splitting(blocks, mb.input_ids.shape[0]):
                kwargs = {"attention_mask": varlen.placeholder_mask(ctx.device), "rlctl_blocks": blocks}
        with ctx.memory():
            return self.run(root, mb, kwargs)

    def run(self, root, mb, kwargs: dict) -> torch.Tensor:
        """The call for a micro-batch: an RL micro-batch's logits only where the loss reads them."""
        keep = mb.keep_cols if mb.keep_cols is not None else mb.logit_index
        if keep is not None:
            kwargs["logits_to_keep"] = keep
        return self.call(root, mb.input_ids, mb.position_ids, **kwargs)

    def sp_forward(self, root, mb, dims, *, flash: bool):
        """A micro-batch under sequence parallelism: this rank's :class:`~rlctl.engines.ulysses.ShardedLogits`."""
        return ulysses.forward_logits(root, mb, dims, flash=flash)

    # ------------------------------------------------------------------ naming

    def export_modules(self, root: nn.Module) -> list[tuple[nn.Module, str]]:
        """(module, HF name prefix) whose parameters make up the exported model."""
        return [(root, "")]


class PlainCalls:
    """How the engine calls its model when every rank holds whole sequences (sp 1)."""

    def install(self, config, *, varlen_ok: bool) -> None:
        if varlen_ok:  # packed rows split per document (rlctl.engines.varlen)
            varlen.install(config)

    def forward_micro(self, adapter: ModelAdapter, root, mb, ctx: CallContext) -> torch.Tensor:
        return adapter.forward_micro(root, mb, ctx)

    def forward(self, adapter: ModelAdapter, root, input_ids, position_ids, attention_mask, ctx) -> torch.Tensor:
        return adapter.forward(root, input_ids, position_ids, attention_mask, ctx)
