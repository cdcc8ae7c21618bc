"""The modules and tensor helpers the FSDP engine builds with: the critic (a backbone plus a value
head) and its adapter, the whole tensor behind a sharded parameter, and a module's non-persistent buffers.

Critic (PPO, rlctl rm): :class:`CriticAdapter` builds :class:`CriticModel`, the architecture's backbone
(``AutoModel``, the CausalLM without its lm_head) plus ``value_head = Linear(hidden, 1)``; its output is
values ``[B, T]`` in fp32. Its state keys are the CausalLM's ``model.*`` keys plus
``value_head.weight``/``value_head.bias``; LoRA adapters go on the backbone, the value head is trained whole."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlctl.engines import ulysses
from rlctl.engines.adapters import ModelAdapter


class CriticModel(nn.Module):
    """A value model: the architecture's backbone plus a linear value head, values [B, T] in fp32."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.model = backbone
        self.value_head = nn.Linear(hidden_size, 1)

    def forward(self, input_ids, position_ids=None, attention_mask=None, **kwargs):
        hidden = self.model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False, **kwargs
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).to(torch.float32, copy=True)  # a copy, not a view


class CriticAdapter(ModelAdapter):
    """A value model (:class:`CriticModel`): its output is values at every position."""

    kind = "critic"

    def auto_class(self):
        from transformers import AutoModel

        return AutoModel

    def finish(self, model: nn.Module, config, *, train_vision: bool, param_dtype, pretrained: bool) -> nn.Module:
        critic = CriticModel(model, config.hidden_size)
        critic.value_head.to(param_dtype)
        if pretrained:
            nn.init.normal_(critic.value_head.weight, std=getattr(config, "initializer_range", 0.02))
            nn.init.zeros_(critic.value_head.bias)
        return critic

    def lora_host(self, model: nn.Module) -> nn.Module:
        return model.model  # the backbone (CriticModel.model may be peft's wrapper)

    def with_lora(self, model: nn.Module, peft_model: nn.Module) -> tuple[nn.Module, nn.Module]:
        model.model = peft_model
        return model, model

    def shares_prefix(self, *, varlen: bool, attn: str) -> bool:
        return False

    def call(self, root: nn.Module, input_ids, position_ids, **kwargs) -> torch.Tensor:
        return root(input_ids, position_ids=position_ids, **kwargs)

    def run(self, root, mb, kwargs: dict) -> torch.Tensor:
        return self.call(root, mb.input_ids, mb.position_ids, **kwargs)  # values at every position

    def sp_forward(self, root, mb, dims, *, flash: bool) -> torch.Tensor:
        return ulysses.forward_values(root, mb, dims, flash=flash)

    def export_modules(self, root: nn.Module) -> list[tuple[nn.Module, str]]:
        return [(self.hf_model(root), "model."), (root.value_head, "value_head.")]


def _full(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded, possibly CPU-offloaded) parameter."""
    if isinstance(t, DTensor):
        local = t.to_local().to(device)
        return DTensor.from_local(
            local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        ).full_tensor()
    return t.detach().to(device)


def _non_persistent_buffers(module: nn.Module) -> list[tuple[str, str]]:
    return [
        (mod_name, name)
        for mod_name, mod in module.named_modules()
        for name, _ in mod.named_buffers(recurse=False)
        if name in mod._non_persistent_buffers_set
    ]
