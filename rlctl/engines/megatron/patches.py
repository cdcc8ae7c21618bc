"""Version-pinned fixes of megatron-core (0.16.1) that the engine applies around its calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# megatron-core 0.16.1 without Transformer Engine or apex steps with torch's AdamW, whose per-parameter
# state holds the step count; its distributed optimizer cannot load a checkpoint into it as it is:


def _torch_adam_optimizers(optimizer) -> list:
    """The distributed optimizers (of a chained one) that step with torch's Adam/AdamW."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt for opt in chained if isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW)]


def init_torch_adam_state(optimizer) -> None:
    """Give a fresh torch AdamW its state (megatron-core reads the step count there before loading), by
    one step of zero gradients at lr 0, which changes no weight."""
    for opt in _torch_adam_optimizers(optimizer):
        inner = opt.optimizer
        if inner.state:
            continue
        lrs = [group["lr"] for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"] = 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)
        for group, lr in zip(inner.param_groups, lrs):
            group["lr"] = lr


@contextlib.contextmanager
def torch_adam_load_fix(optimizer) -> Iterator[None]:
    """While loading: megatron-core puts the checkpoint's step count into every torch AdamW state (one
    tensor shared by all: AdamW would then add 1 to it once per parameter at every step), then copies
    each parameter's checkpointed tensors over that state and expects a 'step' among them, which the
    checkpoint keeps elsewhere (KeyError 'step'). Let the states keep that step, each its own copy."""
    patched = _torch_adam_optimizers(optimizer)
    for opt in patched:
        copy_states = opt._set_main_param_and_optimizer_states

        def keep_step(model_param, tensors, opt=opt, copy_states=copy_states):
            group, order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
            copy_states(model_param, {**tensors, "step": state["step"]} if "step" in state else tensors)

        opt._set_main_param_and_optimizer_states = keep_step
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states
            for state in opt.optimizer.state.values():
                if "step" in state:
                    state["step"] = state["step"].clone()
