"""Let megatron-core run on CPU under gloo, for tests only (import before megatron.core).

megatron-core assumes CUDA in a few places that do not matter on CPU:

* ``torch.cuda.current_device()`` names the device of DDP's gradient buffers and of the
  torch_dist checkpoint writer -> "cpu";
* ``torch.cuda.synchronize()`` in the checkpoint writer -> no-op;
* ``Tensor.cuda()`` when the last pipeline stage syncs its copy of tied embeddings -> the tensor itself;
* attention forks the CUDA RNG tracker (for dropout, 0 here) -> a null context;
* the pipeline schedules create small counters with ``device="cuda"`` -> created on CPU.
"""

import contextlib
import functools

import torch

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


for _name in ("zeros", "ones", "empty", "tensor", "full"):
    setattr(torch, _name, _on_cpu(getattr(torch, _name)))

from megatron.core import tensor_parallel


class _NoRngTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


tensor_parallel.get_cuda_rng_tracker = _NoRngTracker
