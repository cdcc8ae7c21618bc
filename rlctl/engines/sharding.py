"""How the FSDP2 engine builds its model (the same on every rank): :func:`build_sharded_model`, a function of
what to build (:class:`BuildSpec`: the adapter, weights, attention, LoRA) and where it goes
(:class:`Placement`: device, ranks, precision, offload), as torchtitan's parallelize functions are:

1. the architecture is instantiated on the *meta* device (no memory) by the model adapter
   (:mod:`rlctl.engines.adapters`), LoRA adapters are added with peft when ``lora.rank > 0``;
2. ``fully_shard`` wraps every decoder layer (the model's ``_no_split_modules``) and then the HF
   model itself as the root (with LoRA the inner HF model is the root, not peft's wrapper, so
   ``generate`` keeps working);
3. the shards are allocated (``to_empty``), rank 0 loads the real weights on CPU and broadcasts
   them one tensor at a time, each rank keeping its shard; non-persistent buffers (RoPE's
   ``inv_freq``), which no state dict carries, are broadcast from rank 0's copy too.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from rlctl.engines.adapters import ModelAdapter
from rlctl.engines.dims import ParallelDims
from rlctl.engines.modules import _non_persistent_buffers
from rlctl.engines.savers import checkpoint_mlp
from rlctl.engines.spec import LoraSpec
from rlctl.errors import UserError, did_you_mean

if TYPE_CHECKING:
    from rlctl.engines.base import ModelSource


@dataclass(frozen=True)
class Precision:
    """The dtypes of a model: its forward and backward, what the optimizer steps, the frozen weights."""

    compute: torch.dtype
    param: torch.dtype  # trained weights: fp32 master weights (mixed precision), bf16 (pure bf16)
    frozen: torch.dtype  # the base: the compute dtype when frozen (reference, LoRA's base, pure bf16), else fp32
    pure_bf16: bool

    @property
    def mixed(self) -> bool:
        """fp32 weights, a lower-precision forward and backward."""
        return self.param == torch.float32 and self.compute != torch.float32


@dataclass(frozen=True)
class Placement:
    """Where a model goes: the device, the ranks, whether it is sharded, offloaded, trained; its dtypes."""

    device: torch.device
    dims: ParallelDims
    sharded: bool  # False: the plain module on one device
    offload: bool  # parameters (and optimizer states) on the host (FSDP2's CPUOffloadPolicy)
    trainable: bool
    precision: Precision


@dataclass(frozen=True)
class BuildSpec:
    """What to build."""

    adapter: ModelAdapter
    source: ModelSource  # where the weights come from
    hf_config: object  # the transformers config (the meta model shares it; rank 0's copy does not)
    attn: str
    lora: LoraSpec | None  # None: no adapters (full fine-tuning, or a frozen model)
    train_vision: bool
    seed: int  # random weights, LoRA's A, the value head
    activation_checkpointing: bool
    selective_checkpointing: bool
    install_attention: Callable[[object], None]  # (hf config): the attention the engine calls with (its calls')


@dataclass(frozen=True)
class ModelParts:
    """A built model: the FSDP root that runs forward, the module checkpointed, the transformers model inside."""

    root: nn.Module
    state: nn.Module
    hf: nn.Module


def build_sharded_model(spec: BuildSpec, placement: Placement) -> ModelParts:
    """The model of ``spec`` on meta, sharded over ``placement``'s ranks and filled with rank 0's weights."""
    with torch.device("meta"):
        root, state = _build(spec, placement, spec.hf_config)
    parts = ModelParts(root, state, spec.adapter.hf_model(root))
    spec.install_attention(parts.hf.config)
    _apply_fsdp(spec, placement, parts)
    _materialize(spec, placement, parts)
    return parts


def _build(spec: BuildSpec, placement: Placement, config, *, pretrained: bool = False) -> tuple[nn.Module, nn.Module]:
    """Return (the FSDP root that runs forward, the module whose state dict is checkpointed)."""
    adapter, precision = spec.adapter, placement.precision
    model = adapter.new_model(config, source=spec.source, attn=spec.attn, dtype=precision.frozen, pretrained=pretrained)
    model = adapter.finish(
        model, config, train_vision=spec.train_vision, param_dtype=precision.param, pretrained=pretrained
    )
    if spec.lora is None:
        return model, model
    peft_model = _add_lora(spec, model)
    for p in peft_model.parameters():  # the adapters: fp32 master weights beside the frozen base
        if p.requires_grad:
            p.data = p.data.to(precision.param)
    return adapter.with_lora(model, peft_model)


def _add_lora(spec: BuildSpec, model: nn.Module) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    lc = spec.lora
    targets = spec.adapter.lora_targets(model, lc, train_vision=spec.train_vision)
    lora_cfg = LoraConfig(
        r=lc.rank, lora_alpha=lc.scaled_alpha, lora_dropout=lc.dropout, target_modules=targets, bias="none"
    )
    hf = spec.adapter.lora_host(model)
    try:
        peft_model = get_peft_model(hf, lora_cfg)
    except ValueError as e:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in hf.named_modules() if isinstance(m, nn.Linear)})
        bad = targets[0] if isinstance(targets, list) else targets
        raise UserError(
            f"--lora-targets {lc.targets}: {str(e).splitlines()[0]}{did_you_mean(bad, names)}; "
            f"linear layers here: {', '.join(names)}"
        ) from None
    _check_lora_layers(peft_model)
    return peft_model


def _check_lora_layers(peft_model: nn.Module) -> None:
    from peft.tuners.lora import LoraLayer

    for name, m in peft_model.named_modules():
        if isinstance(m, LoraLayer) and not isinstance(m.get_base_layer(), nn.Linear):
            raise UserError(
                f"LoRA on {name} ({type(m.get_base_layer()).__name__}) is not supported; "
                f"target linear layers only (e.g. --lora-targets all-linear)"
            )


def wrap_units(adapter: ModelAdapter, hf: nn.Module) -> list[nn.Module]:
    """The decoder layers: modules named in the HF model's ``_no_split_modules`` (and the adapter's tower,
    one unit of its own, first)."""
    names = set(getattr(hf, "_no_split_modules", None) or [])
    tower = adapter.tower(hf)
    inside = {id(m) for m in tower.modules()} if tower is not None else set()
    units = [m for m in hf.modules() if type(m).__name__ in names and id(m) not in inside]
    if tower is not None and units:
        units = [tower, *units]
    if not units:
        raise UserError(
            f"{type(hf).__name__} declares no decoder layer class (_no_split_modules); the FSDP engine cannot shard it"
        )
    return units


def _apply_fsdp(spec: BuildSpec, placement: Placement, parts: ModelParts) -> None:
    units = wrap_units(spec.adapter, parts.hf)  # a model without decoder layers is refused, sharded or not
    if spec.activation_checkpointing:
        parts.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif spec.selective_checkpointing:
        tower = spec.adapter.tower(parts.hf)
        for unit in units:
            if unit is not tower:
                checkpoint_mlp(unit)
    if not placement.sharded:
        return
    mesh = init_device_mesh(placement.device.type, (placement.dims.world,), mesh_dim_names=("dp",))
    precision = placement.precision
    mp = MixedPrecisionPolicy()
    if placement.trainable and precision.mixed:  # (pure bf16 and frozen models: one dtype throughout)
        mp = MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=True) if placement.offload else OffloadPolicy()
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload)
    # FSDP2 keeps the ROOT's parameters (embedding, final norm, lm_head) unsharded after a forward, for
    # the backward that follows; a frozen model has none, so its root reshards like every layer
    # (else the reference model's root stays gathered on every GPU through rollout and update)
    root_reshard = None if placement.trainable else True
    fully_shard(parts.root, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=root_reshard)


def _materialize(spec: BuildSpec, placement: Placement, parts: ModelParts) -> None:
    """Allocate the shards and fill them with rank 0's weights (and non-persistent buffers)."""
    device, model = placement.device, parts.root
    buffers = _non_persistent_buffers(model)
    model.to_empty(device="cpu" if placement.offload else device)
    full_sd, ref = {}, None
    if placement.dims.rank == 0:
        with torch.random.fork_rng(devices=[]):  # seeded init (random weights, LoRA's A, value head)
            torch.manual_seed(spec.seed)
            # a copy: from_config sets the config's attention back to sdpa, and the sharded model shares
            # this config (rank 0 would run plain sdpa, not rlctl's attention: a wrong mask, a hang with sp)
            ref, state_module = _build(spec, placement, copy.deepcopy(spec.hf_config), pretrained=True)
        full_sd = state_module.state_dict()
    _scatter_from_rank0(parts.state, full_sd, device, placement.dims.rank)
    for mod_name, name in buffers:
        module = model.get_submodule(mod_name)
        value = torch.empty_like(module.get_buffer(name), device=device)
        if ref is not None:
            value.copy_(ref.get_submodule(mod_name).get_buffer(name))
        dist.broadcast(value, src=0)
        module.register_buffer(name, value, persistent=False)
    if placement.offload:  # buffers must live where the compute happens
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf.device != device:
                    module.register_buffer(
                        name, buf.to(device), persistent=name not in module._non_persistent_buffers_set
                    )
    del full_sd, ref


def _scatter_from_rank0(state_module: nn.Module, full_sd: dict[str, torch.Tensor], device, rank: int) -> None:
    """Copy rank 0's full state dict into every rank's shards, one tensor at a time.

    (``set_model_state_dict(broadcast_from_rank0=True)`` would hold the whole model on every
    device at once.)
    """
    with torch.no_grad():
        for name, local in state_module.state_dict().items():
            full = torch.empty(local.shape, dtype=local.dtype, device=device)
            if rank == 0:
                if name not in full_sd:
                    raise RuntimeError(f"rank 0's model has no '{name}'")
                full.copy_(full_sd[name])
            dist.broadcast(full, src=0)
            if isinstance(local, DTensor):
                shard = distribute_tensor(full, local.device_mesh, local.placements, src_data_rank=None)
                local.to_local().copy_(shard.to_local())
            else:
                local.copy_(full)
