"""The FSDP2 training engine shared by sft, grpo and ppo.

How a model is built (the same on every rank, see :class:`FSDPEngine`):

1. the architecture is instantiated on the *meta* device (no memory), LoRA adapters are added
   with peft when ``lora.rank > 0``;
2. ``fully_shard`` wraps every decoder layer (the model's ``_no_split_modules``) and then the HF
   model itself as the root (with LoRA the inner HF model is the root, not peft's wrapper, so
   ``generate`` keeps working);
3. the shards are allocated (``to_empty``), rank 0 loads the real weights on CPU and broadcasts
   them one tensor at a time, each rank keeping its shard; non-persistent buffers (RoPE's
   ``inv_freq``), which no state dict carries, are broadcast from rank 0's copy too.

Precision: trained parameters (the master weights) and optimizer states are fp32; on GPU the
forward and backward run in bf16 and gradients are reduced in fp32 (``MixedPrecisionPolicy``); on
CPU everything is fp32. Frozen weights are held in the compute dtype: a frozen model (the reference
policy), and with LoRA the frozen base model (only the adapters, and a critic's value head, are
trained and kept in fp32).

Gradients are SUMMED over ranks (see :mod:`rlctl.engines.base`), clipped by their global norm,
and AdamW steps with a linear warmup then cosine decay to ``min_lr_ratio`` of the peak.

Critic (PPO): ``role="critic"`` builds :class:`CriticModel`, the architecture's backbone
(``AutoModel``, the CausalLM without its lm_head) plus ``value_head = Linear(hidden, 1)``;
``forward`` returns values ``[B, T]`` in fp32. Its state keys are the CausalLM's ``model.*`` keys
plus ``value_head.weight``/``value_head.bias``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, distribute_tensor

from rlctl.data.packing import MicroBatch
from rlctl.data.vision import is_vision_config
from rlctl.engines import ulysses, varlen
from rlctl.engines.base import ModelSource, TrainEngine, full_logits
from rlctl.engines.modules import CriticModel, _full, _non_persistent_buffers
from rlctl.engines.savers import HostActivations, checkpoint_mlp
from rlctl.engines.spec import EngineSpec
from rlctl.engines.vision import dummy_tower, language_linear_names, vision_kwargs, vision_tower
from rlctl.engines.vision_prefix import shared_rope_position_ids
from rlctl.errors import UserError, did_you_mean

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class FSDPEngine(TrainEngine):
    """One model sharded with FSDP2 over all ranks, with its optimizer (when trainable).

    Args:
        spec: what to build (the model, placement, precision, memory options, optimizer and LoRA).
        role: "actor" / "ref" (a CausalLM, forward gives logits) or "critic" (values).
        trainable: False for a frozen model (no optimizer, weights in the compute dtype).
        total_steps: optimizer steps of the run (for the lr schedule).
        source: where the weights come from (default ``spec.model``); e.g. a PPO critic from another model.

    LoRA (``spec.lora.rank`` > 0) applies to trainable actors and critics, never to the reference.
    """

    backend = "fsdp"

    def __init__(
        self,
        spec: EngineSpec,
        *,
        role: str = "actor",
        trainable: bool = True,
        total_steps: int = 0,
        source: ModelSource | None = None,
    ):
        self._setup(spec, role=role, trainable=trainable, total_steps=total_steps, source=source)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.sp = self._sp_groups(spec)
        self.compute_dtype = self._compute_dtype(spec)
        self.attn = self._attn(spec)
        self.offload = self.device.type == "cuda" and (spec.offload_params or spec.offload_optimizer)
        self.lora_rank = spec.lora.rank if trainable and role != "ref" else 0
        self.pure_bf16 = self._pure_bf16(spec)
        # what the optimizer steps: fp32 master weights (mixed precision), or bf16 ones (pure bf16)
        self.param_dtype = torch.bfloat16 if self.pure_bf16 else torch.float32 if trainable else self.compute_dtype
        frozen = self.lora_rank or not trainable or self.pure_bf16
        self.frozen_dtype = self.compute_dtype if frozen else torch.float32  # the base
        self.sharded = self._sharded(spec)
        self.vision = is_vision_config(self.hf_config)  # a VL model (rlctl.engines.vision)
        if self.vision and role == "critic":
            raise UserError("a vision-language model cannot be a PPO critic yet; train it with grpo (no critic)")

        with torch.device("meta"):
            self.model, self._state_module = self._build(self.hf_config)
        # packed rows split per document (rlctl.engines.varlen); VL models: transformers' packed masks instead
        self.varlen = self.attn == "sdpa" and not self.vision
        if self.sp is not None:  # Ulysses around the per-document attention (rlctl.engines.ulysses)
            ulysses.install(self._hf_model().config)
        elif self.varlen:
            varlen.install(self._hf_model().config)
        self._apply_fsdp(spec.activation_checkpointing, spec.selective_checkpointing)
        self._materialize()
        self.optimizer = None
        if trainable:
            self._build_optimizer()
        else:
            self._state_module.requires_grad_(False)
        self.train(trainable)

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _compute_dtype(spec: EngineSpec) -> torch.dtype:
        if spec.dtype not in DTYPES:
            raise UserError(f"the FSDP engine trains in bf16 or fp32, not {spec.dtype}; set model.dtype=bf16")
        return DTYPES[spec.dtype]

    def _pure_bf16(self, spec: EngineSpec) -> bool:
        """bf16 weights, gradients and AdamW states (8 bytes/param, not 16); accuracy caveat in savers.py."""
        if spec.precision != "bf16":
            return False
        if spec.dtype != "bf16":
            raise UserError(f"train.precision=bf16 (pure bf16) needs model.dtype=bf16, not {spec.dtype}")
        return self.trainable

    def _sharded(self, spec: EngineSpec) -> bool:
        if not spec.shard and self.world > 1:
            raise UserError(
                f"parallel.shard=false runs the plain module on one device, not {self.world}; "
                f"remove parallel.shard=false or use one GPU"
            )
        if not spec.shard and self.offload:
            raise UserError("parameter/optimizer offload is FSDP2's CPUOffloadPolicy: keep parallel.shard on for it")
        return spec.shard

    def _sp_groups(self, spec: EngineSpec) -> ulysses.SPGroups | None:
        """The (dp, sp) groups of Ulysses sequence parallelism (None: sp 1)."""
        if spec.sp == 1:
            return None
        c = self.hf_config
        if is_vision_config(c):
            raise UserError(
                f"parallel.sp={spec.sp}: a vision-language model is not split by sequence; use parallel.sp=1"
            )
        ulysses.check(spec.sp, self.world, c.num_attention_heads, getattr(c, "num_key_value_heads", None) or 1)
        return ulysses.sp_groups(spec.sp, self.device.type)

    def _attn(self, spec: EngineSpec) -> str:
        attn = spec.attn  # None unless the user chose (the plan's attn is a forecast, not an order)
        if spec.sp > 1:
            if attn not in (None, "sdpa"):
                raise UserError(f"parallel.sp={spec.sp} runs attention with sdpa per document; set model.attn=sdpa")
            return "sdpa"
        has_flash = importlib.util.find_spec("flash_attn") is not None
        if attn is None:
            return "flash_attention_2" if self.device.type == "cuda" and has_flash else "sdpa"
        if attn == "flash_attention_2" and (self.device.type != "cuda" or not has_flash):
            raise UserError("model.attn=flash_attention_2 needs a GPU and the flash-attn package; use model.attn=sdpa")
        return attn

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

    def _build_optimizer(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        o = self.spec.optimizer
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.peak_lr * self._lr_factor(0),
            betas=o.betas,
            eps=1e-8,
            fused=True,  # one kernel for every parameter (the per-tensor loop costs ms on small models)
        )
        self._trainable = params

    # ------------------------------------------------------------------ training

    def _memory_context(self) -> contextlib.ExitStack:
        """Activations saved to host memory; unsharded mixed precision autocasts to the compute dtype."""
        stack = contextlib.ExitStack()
        if self.spec.offload_activations and self.trainable and torch.is_grad_enabled():
            stack.enter_context(HostActivations(pin_memory=self.device.type == "cuda"))
        mixed = self.param_dtype == torch.float32 and self.compute_dtype != torch.float32
        if not self.sharded and mixed:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.compute_dtype))
        return stack

    def forward(self, input_ids, position_ids, attention_mask=None) -> torch.Tensor:
        if self.sp is not None:
            return full_logits(self.forward_micro(MicroBatch(input_ids, position_ids, input_ids, attention_mask)))
        with self._memory_context():
            if self.role == "critic":
                return self.model(input_ids, position_ids=position_ids, attention_mask=attention_mask)
            return self.model(
                input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
            ).logits

    def forward_micro(self, mb) -> torch.Tensor:
        """One micro-batch's output, with as little wasted work as the layout allows: packed rows (and
        shared-prefix rows) attend per document (:mod:`rlctl.engines.varlen`, with sdpa), and an RL
        micro-batch's logits are computed only where the loss reads them (``logits_to_keep``)."""
        if self.vision:
            return self._forward_vision(mb)
        if self.sp is not None:  # each rank its shard of the sequence (rlctl.engines.ulysses)
            with self._memory_context():
                return ulysses.forward(self.model, mb, self.sp, critic=self.role == "critic")
        blocks, mask = mb.blocks, mb.attention_mask
        kwargs = {"attention_mask": mask}
        if blocks is not None:  # shared-prefix rows: a call per block, or one masked call (short rows, eager)
            kwargs = varlen.attention_kwargs(blocks, mb.input_ids, split=self.varlen)
        elif mask is None and self.varlen:  # packed rows: one call per document
            blocks = varlen.blocks_from_positions(mb.position_ids)
            if varlen.worth_splitting(blocks, mb.input_ids.shape[0]):
                kwargs = {"attention_mask": varlen.placeholder_mask(self.device), "rlctl_blocks": blocks}
        with self._memory_context():
            if self.role == "critic":
                return self.model(mb.input_ids, position_ids=mb.position_ids, **kwargs)
            keep = mb.keep_cols if mb.keep_cols is not None else mb.logit_index
            if keep is not None:
                kwargs["logits_to_keep"] = keep
            return self.model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, **kwargs).logits

    def _forward_vision(self, mb) -> torch.Tensor:
        """A VL model's logits for one micro-batch: its pixels and multimodal rope positions
        (:mod:`rlctl.engines.vision`); packed rows give their text positions too, for per-document masks;
        shared-prefix rows (GRPO) their blocks' dense mask and positions (:mod:`rlctl.engines.vision_prefix`)."""
        hf = self._hf_model()
        if mb.blocks is not None:  # each group's prompt (its images too) once, then its responses
            kwargs = varlen.attention_kwargs(mb.blocks, mb.input_ids, split=False)
            kwargs["position_ids"] = shared_rope_position_ids(hf, mb)
            if mb.pixel_values is not None:
                kwargs.update(pixel_values=mb.pixel_values, image_grid_thw=mb.image_grid_thw)
        else:
            kwargs = vision_kwargs(hf, mb, packed_text=mb.attention_mask is None)
            kwargs["attention_mask"] = mb.attention_mask
        keep = mb.keep_cols if mb.keep_cols is not None else mb.logit_index
        if keep is not None:
            kwargs["logits_to_keep"] = keep
        dummy = mb.pixel_values is None and self.sharded and self.world > 1  # every rank gathers the tower
        with self._memory_context(), dummy_tower(hf) if dummy else contextlib.nullcontext():
            return self.model(input_ids=mb.input_ids, use_cache=False, **kwargs).logits

    @property
    def shares_prefix(self) -> bool:
        """Shared-prefix micro-batches run where packed rows attend per block (sdpa through
        :mod:`rlctl.engines.varlen`); eager attention would add their boolean mask instead of applying
        it, and flash-attention's varlen kernels cannot take it: those keep the packed rows. VL models (varlen
        off) run them with sdpa and the blocks' dense mask."""
        return self.role != "critic" and (self.varlen or (self.vision and self.attn == "sdpa"))

    # ------------------------------------------------------------------ data-parallel coordinates (sp > 1)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank() if self.sp is None else self.sp.dp_rank

    @property
    def dp_size(self) -> int:
        return dist.get_world_size() if self.sp is None else self.sp.dp_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return None if self.sp is None else self.sp.dp_group

    @property
    def mp_size(self) -> int:
        """The SP ranks split each sequence of the micro-batches they share."""
        return 1 if self.sp is None else self.sp.size

    @property
    def mp_group(self) -> dist.ProcessGroup | None:
        return None if self.sp is None else self.sp.group

    def backward(self, loss: torch.Tensor, *, sync: bool = True) -> None:
        if not self.trainable:
            raise RuntimeError(f"the {self.role} engine is frozen")
        # ``sync`` is not used: FSDP reduce-scatters every micro-batch's gradients, as verl and torchtitan do.
        # Deferring it to the last micro-batch would keep every parameter's unsharded fp32 gradient until the
        # step (4 bytes per parameter per GPU: 28 GiB for a 7B model), which the memory plan does not budget.
        # FSDP averages gradients over ranks; the ranks' losses are shares of one sum, so undo it.
        (loss * self.world if self.world > 1 else loss).backward()

    def step(self) -> float:
        clip = self.spec.optimizer.grad_clip if self.spec.optimizer.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._trainable, clip)
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if math.isfinite(norm):
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return norm

    # ------------------------------------------------------------------ state

    def _reshard(self) -> None:
        """Put every FSDP module back in sharded form (a no-grad forward leaves the root unsharded)."""
        for m in self.model.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def state_dict(self) -> dict:
        self._reshard()
        state = {"model": get_model_state_dict(self._state_module)}
        if self.trainable:
            state["optim"] = get_optimizer_state_dict(self._state_module, self.optimizer)
            state["scheduler"] = {"step": self.global_step}
        return state

    def load_state_dict(self, state: dict) -> None:
        self._reshard()
        set_model_state_dict(self._state_module, state["model"])
        if self.trainable and "optim" in state:
            set_optimizer_state_dict(self._state_module, self.optimizer, state["optim"])
            for group in self.optimizer.param_groups:  # checkpoints from before fused AdamW say fused=None
                group["fused"] = True
            self.global_step = int(state["scheduler"]["step"])

    def lora_info(self) -> dict | None:
        if not self.lora_rank:
            return None
        peft_model = self._state_module.model if self.role == "critic" else self._state_module
        cfg = peft_model.peft_config["default"].to_dict()
        return {
            k: (sorted(v) if isinstance(v, set) else v)
            for k, v in cfg.items()
            if k in ("r", "lora_alpha", "lora_dropout", "target_modules", "bias")
        }

    def save_lora_config(self, out_dir: str | Path) -> None:
        peft_model = self._state_module.model if self.role == "critic" else self._state_module
        peft_model.peft_config["default"].save_pretrained(str(out_dir))

    # ------------------------------------------------------------------ full weights

    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor on this engine's device) for every parameter, on every rank.

        One tensor is gathered at a time. LoRA layers are merged: ``W + scaling * B @ A`` under the
        base layer's HF name. Tied weights are yielded once.
        """
        from peft.tuners.lora import LoraLayer

        self._reshard()
        seen: set[int] = set()

        def cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype) if dtype is not None and t.is_floating_point() else t

        def walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
            if isinstance(module, LoraLayer):
                base = module.get_base_layer()
                weight = _full(base.weight, self.device)
                for adapter in module.active_adapters:
                    a = _full(module.lora_A[adapter].weight, self.device).float()
                    b = _full(module.lora_B[adapter].weight, self.device).float()
                    weight = (weight.float() + (b @ a) * module.scaling[adapter]).to(weight.dtype)
                yield prefix + "weight", cast(weight)
                if base.bias is not None:
                    yield prefix + "bias", cast(_full(base.bias, self.device))
                return
            for name, p in module.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    yield prefix + name, cast(_full(p, self.device))
            for name, child in module.named_children():
                yield from walk(child, f"{prefix}{name}.")

        if self.role == "critic":  # CriticModel.model may be peft's wrapper: walk the backbone itself
            yield from walk(self._hf_model(), "model.")
            yield from walk(self.model.value_head, "value_head.")
        else:
            yield from walk(self.model, "")
