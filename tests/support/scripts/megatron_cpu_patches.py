"""Let megatron-core run on CPU under gloo, for tests only (import before megatron.core).

megatron-core assumes CUDA in a few places that do not matter on CPU:

* ``torch.cuda.current_device()`` names the device of DDP's gradient buffers and of the
  torch_dist checkpoint writer -> "cpu";
* ``torch.cuda.synchronize()`` in the checkpoint writer -> no-op;
* ``Tensor.cuda()`` when the last pipeline stage syncs its copy of tied embeddings -> the tensor itself;
* attention forks the CUDA RNG tracker (for dropout, 0 here) -> a null context;
* the pipeline schedules create small counters with ``device="cuda"`` -> created on CPU;
* the distributed optimizer accepts only parameters whose ``Tensor.type()`` names a CUDA tensor ->
  ``type()`` (without arguments) names CPU tensors as their CUDA counterparts.
"""

import contextlib
import functools

import torch
import torch.utils._device

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
torch.Tensor.cuda = lambda self, *args, **kwargs: self


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapped(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return wrapped


# torch's device context managers (``with torch.device("meta")``, which transformers loads models
# under) recognise factories by identity in a cached set: fill that cache with the real ones first.
torch.utils._device._device_constructors()
for _name in ("zeros", "ones", "empty", "tensor", "full"):
    setattr(torch, _name, _on_cpu(getattr(torch, _name)))

_tensor_type = torch.Tensor.type


def _type_as_if_cuda(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs:
        name = _tensor_type(self)
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    return _tensor_type(self, dtype, non_blocking, **kwargs)


torch.Tensor.type = _type_as_if_cuda

from megatron.core import tensor_parallel


class _NoRngTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


tensor_parallel.get_cuda_rng_tracker = _NoRngTracker
