"""The modules and tensor helpers the FSDP engine builds with: the critic (a backbone plus a value
head), the whole tensor behind a sharded parameter, and a module's non-persistent buffers."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


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
