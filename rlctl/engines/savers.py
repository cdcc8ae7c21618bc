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
    """Activation offloading: every tensor autograd saves for the backward is copied to host memory and
    brought back when the backward needs it, so the device keeps only the layer being computed. Like
    ``torch.autograd.graph.save_on_cpu``, except that

    * parameters are kept as they are: the module holds them anyway (FSDP2's unsharded ones are gathered
      again for the backward), and copying them would move about the model's bytes over PCIe twice per
      micro-batch for nothing;
    * on CUDA the device-to-host copy is non-blocking, into pinned memory, on a stream of its own
      (:class:`SideStreamCopies`), so the forward does not wait for PCIe; the backward's stream waits for
      that copy before it reads the host tensor back;
    * a tensor already on the CPU is copied too (blocking): the forward's own activation is freed either
      way (on CPU runs this only matters for measuring the effect).
    """

    def __init__(self, device: torch.device):
        copies = SideStreamCopies(device) if device.type == "cuda" else None

        def pack(t: torch.Tensor):
            if isinstance(t, nn.Parameter):
                return t
            if copies is not None and t.device.type == "cuda":
                return copies.to_host(t)
            host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout)
            host.copy_(t)
            return t.device, host, None

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host, copied = packed
            if copied is None:
                return host.to(device)
            return copies.to_device(host, device, copied)

        super().__init__(pack, unpack)


class SideStreamCopies:
    """Device-to-host copies of saved activations that do not hold up the forward: each one runs on a side
    stream, after the work that wrote the tensor, into pinned host memory (a non-blocking copy from
    pageable memory would be synchronous). The device tensor is recorded on the side stream, so the caching
    allocator does not hand its memory to the forward's next kernels before the copy has read it; an event
    marks the copy's end, and the backward's stream waits for it before copying the tensor back."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def to_host(self, t: torch.Tensor):
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        t.record_stream(self.stream)
        return t.device, host, copied

    @staticmethod
    def to_device(host: torch.Tensor, device: torch.device, copied) -> torch.Tensor:
        torch.cuda.current_stream(device).wait_event(copied)  # the host copy is complete
        return host.to(device, non_blocking=True)


def checkpoint_mlp(layer: nn.Module) -> None:
    """Selective activation checkpointing: the decoder layer's MLP is recomputed in the backward (only
    its input is kept); attention keeps its saved tensors. The MLP's gate, up and activation values
    (4 x intermediate per token) are the largest part of a layer's activations."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        raise UserError(f"{type(layer).__name__} has no .mlp: use full activation checkpointing instead")
    inner = mlp.forward
    mlp.forward = functools.partial(torch.utils.checkpoint.checkpoint, inner, use_reentrant=False)
