"""How the FSDP2 engine builds its model (the same on every rank; :class:`ShardedModel`, the part of
:class:`rlctl.engines.fsdp.FSDPEngine` that builds it):


1. the architecture is instantiated on the *meta* device (no memory), LoRA adapters are added
   with peft when ``lora.rank > 0``;
2. ``fully_shard`` wraps every decoder layer (the model's ``_no_split_modules``) and then the HF
   model itself as the root (with LoRA the inner HF model is the root, not peft's wrapper, so
   ``generate`` keeps working);
3. the shards are allocated (``to_empty``), rank 0 loads the real weights on CPU and broadcasts
   them one tensor at a time, each rank keeping its shard; non-persistent buffers (RoPE's
   ``inv_freq``), which no state dict carries, are broadcast from rank 0's copy too.

:class:`ShardedModel` holds no state of its own: ``FSDPEngine.__init__`` sets what it reads (spec, role,
source, rank, world, device, attn, vision, lora_rank, param_dtype, frozen_dtype, sharded, offload, ...).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from rlctl.engines.modules import CriticModel, _non_persistent_buffers
from rlctl.engines.savers import checkpoint_mlp
from rlctl.engines.vision import language_linear_names, vision_tower
from rlctl.errors import UserError, did_you_mean


class ShardedModel:
    """FSDPEngine's model construction: the architecture (and LoRA) on meta, fully_shard, the shards filled."""

    def _new_model(self, config, *, pretrained: bool) -> nn.Module:
        """The bare architecture (meta) or the real weights (rank 0), before LoRA."""
        from transformers import AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

        cls = (
            AutoModel if self.role == "critic" else AutoModelForImageTextToText if self.vision else AutoModelForCausalLM
        )
        kwargs = {"attn_implementation": self.attn, "dtype": self.frozen_dtype}
        if pretrained and not self.source.random_init:
            try:  # the checkpoint's own dtype: half the host memory for bf16 weights; copies upcast exactly
                model = cls.from_pretrained(self.source.path, config=config, **{**kwargs, "dtype": "auto"})
            except (OSError, ValueError) as e:
                raise UserError(f"cannot load the weights of '{self.source.path}': {str(e).splitlines()[0]}") from None
        else:
            model = cls.from_config(config, **kwargs)
        if self.vision and not self.spec.train_vision:
            vision_tower(model).requires_grad_(False)  # frozen unless --train-vision
        if self.role == "critic":
            model = CriticModel(model, config.hidden_size)
            model.value_head.to(self.param_dtype)
            if pretrained:
                nn.init.normal_(model.value_head.weight, std=getattr(config, "initializer_range", 0.02))
                nn.init.zeros_(model.value_head.bias)
        return model

    def _build(self, config, *, pretrained: bool = False) -> tuple[nn.Module, nn.Module]:
        """Return (the FSDP root that runs forward, the module whose state dict is checkpointed)."""
        model = self._new_model(config, pretrained=pretrained)
        if not self.lora_rank:
            return model, model
        from peft import LoraConfig, get_peft_model

        lc = self.spec.lora
        targets = lc.target_modules
        if self.vision and targets == "all-linear":  # the language model's layers (the tower's when trained)
            targets = language_linear_names(model, with_vision=self.spec.train_vision)
        lora_cfg = LoraConfig(
            r=self.lora_rank,
            lora_alpha=lc.scaled_alpha,
            lora_dropout=lc.dropout,
            target_modules=targets,
            bias="none",
        )
        hf = model.model if self.role == "critic" else model
        try:
            peft_model = get_peft_model(hf, lora_cfg)
        except ValueError as e:
            names = sorted({n.rsplit(".", 1)[-1] for n, m in hf.named_modules() if isinstance(m, nn.Linear)})
            bad = targets[0] if isinstance(targets, list) else targets
            raise UserError(
                f"--lora-targets {lc.targets}: {str(e).splitlines()[0]}{did_you_mean(bad, names)}; "
                f"linear layers here: {', '.join(names)}"
            ) from None
        self._check_lora_layers(peft_model)
        for p in peft_model.parameters():  # the adapters: fp32 master weights beside the frozen base
            if p.requires_grad:
                p.data = p.data.to(self.param_dtype)
        if self.role == "critic":
            model.model = peft_model
            return model, model
        return peft_model.base_model.model, peft_model

    @staticmethod
    def _check_lora_layers(peft_model: nn.Module) -> None:
        from peft.tuners.lora import LoraLayer

        for name, m in peft_model.named_modules():
            if isinstance(m, LoraLayer) and not isinstance(m.get_base_layer(), nn.Linear):
                raise UserError(
                    f"LoRA on {name} ({type(m.get_base_layer()).__name__}) is not supported; "
                    f"target linear layers only (e.g. --lora-targets all-linear)"
                )

    def _hf_model(self) -> nn.Module:
        """The transformers model inside: the CausalLM (actor/ref) or the critic's backbone, without peft."""
        from peft import PeftModel

        hf = self.model.model if self.role == "critic" else self.model
        return hf.base_model.model if isinstance(hf, PeftModel) else hf

    def _wrap_units(self) -> list[nn.Module]:
        """The decoder layers: modules named in the HF model's ``_no_split_modules``."""
        hf = self._hf_model()
        names = set(getattr(hf, "_no_split_modules", None) or [])
        tower = vision_tower(hf) if self.vision else None
        inside = {id(m) for m in tower.modules()} if tower is not None else set()
        units = [m for m in hf.modules() if type(m).__name__ in names and id(m) not in inside]
        if tower is not None and units:
            units = [tower, *units]  # the vision tower is one unit of its own
        if not units:
            raise UserError(
                f"{type(hf).__name__} declares no decoder layer class (_no_split_modules); "
                f"the FSDP engine cannot shard it"
            )
        return units

    def _apply_fsdp(self, activation_checkpointing: bool, selective: bool = False) -> None:
        if activation_checkpointing:
            self._hf_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif selective:
            for unit in self._wrap_units():
                if not self.vision or unit is not vision_tower(self._hf_model()):
                    checkpoint_mlp(unit)
        if not self.sharded:
            self._wrap_units()  # the same check: a model without decoder layers is refused either way
            return
        mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("dp",))
        mp = MixedPrecisionPolicy()
        if self.trainable and not self.pure_bf16 and self.compute_dtype != torch.float32:
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy(pin_memory=True) if self.offload else OffloadPolicy()
        for unit in self._wrap_units():
            fully_shard(unit, mesh=mesh, mp_policy=mp, offload_policy=offload)
        # FSDP2 keeps the ROOT's parameters (embedding, final norm, lm_head) unsharded after a forward, for
        # the backward that follows; a frozen model has none, so its root reshards like every layer
        # (else the reference model's root stays gathered on every GPU through rollout and update)
        root_reshard = None if self.trainable else True
        fully_shard(self.model, mesh=mesh, mp_policy=mp, offload_policy=offload, reshard_after_forward=root_reshard)

    def _materialize(self) -> None:
        """Allocate the shards and fill them with rank 0's weights (and non-persistent buffers)."""
        buffers = _non_persistent_buffers(self.model)
        self.model.to_empty(device="cpu" if self.offload else self.device)
        full_sd, ref = {}, None
        if self.rank == 0:
            with torch.random.fork_rng(devices=[]):  # seeded init (random weights, LoRA's A, value head)
                torch.manual_seed(self.spec.seed)
                # a copy: from_config sets the config's attention back to sdpa, and the sharded model shares
                # this config (rank 0 would run plain sdpa, not rlctl's attention: a wrong mask, a hang with sp)
                model, state_module = self._build(copy.deepcopy(self.hf_config), pretrained=True)
            full_sd, ref = state_module.state_dict(), model
        self._scatter_from_rank0(full_sd)
        for mod_name, name in buffers:
            module = self.model.get_submodule(mod_name)
            value = torch.empty_like(module.get_buffer(name), device=self.device)
            if ref is not None:
                value.copy_(ref.get_submodule(mod_name).get_buffer(name))
            dist.broadcast(value, src=0)
            module.register_buffer(name, value, persistent=False)
        if self.offload:  # buffers must live where the compute happens
            for module in self.model.modules():
                for name, buf in module.named_buffers(recurse=False):
                    if buf.device != self.device:
                        module.register_buffer(
                            name, buf.to(self.device), persistent=name not in module._non_persistent_buffers_set
                        )
        del full_sd, ref

    def _scatter_from_rank0(self, full_sd: dict[str, torch.Tensor]) -> None:
        """Copy rank 0's full state dict into every rank's shards, one tensor at a time.

        (``set_model_state_dict(broadcast_from_rank0=True)`` would hold the whole model on every
        device at once.)
        """
        with torch.no_grad():
            for name, local in self._state_module.state_dict().items():
                full = torch.empty(local.shape, dtype=local.dtype, device=self.device)
                if self.rank == 0:
                    if name not in full_sd:
                        raise RuntimeError(f"rank 0's model has no '{name}'")
                    full.copy_(full_sd[name])
                dist.broadcast(full, src=0)
                if isinstance(local, DTensor):
                    shard = distribute_tensor(full, local.device_mesh, local.placements, src_data_rank=None)
                    local.to_local().copy_(shard.to_local())
                else:
                    local.copy_(full)
