"""The FSDP engine's activation-memory savers: selective checkpointing (the MLPs recomputed) and
activation offloading (saved tensors in host memory). Each is measured on CPU in
tests/engines/test_fsdp_memory_options.py and modelled in rlctl/estimate/training.py.

Pure bf16 training (``train.precision=bf16``, the engine's ``_pure_bf16``) has an accuracy caveat:
with no fp32 master copy, an AdamW update smaller than bf16's resolution (about 1/256 of the weight)
is rounded away, so small learning rates and long runs can drift from mixed precision; short
fine-tunes track it closely. It halves the weights, gradients and optimizer states (8 bytes/param).
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch import nn

from rlctl.errors import UserError


class HostActivations(torch.autograd.graph.saved_tensors_hooks):
    """Activation offloading: every tensor autograd saves for the backward is copied to host memory
    (pinned on a GPU host) and brought back when the backward needs it, so the device keeps only the
    layer being computed. Like ``torch.autograd.graph.save_on_cpu``, except that a tensor already on
    the CPU is copied too: the forward's own activation is freed either way (on CPU runs this only
    matters for measuring the effect)."""

    def __init__(self, pin_memory: bool):
        def pack(t: torch.Tensor):
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin_memory)
            host.copy_(t)
            return t.device, host

        def unpack(packed):
            device, host = packed
            return host.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)


def checkpoint_mlp(layer: nn.Module) -> None:
    """Selective activation checkpointing: the decoder layer's MLP is recomputed in the backward (only
    its input is kept); attention keeps its saved tensors. The MLP's gate, up and activation values
    (4 x intermediate per token) are the largest part of a layer's activations."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        raise UserError(f"{type(layer).__name__} has no .mlp: use full activation checkpointing instead")
    inner = mlp.forward
    mlp.forward = functools.partial(torch.utils.checkpoint.checkpoint, inner, use_reentrant=False)
