"""The FSDP2 training engine shared by sft, grpo and ppo.

How a model is built: :mod:`rlctl.engines.sharding` (on meta, LoRA, ``fully_shard`` per decoder layer,
the shards filled from rank 0's weights).

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
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from rlctl.data.packing import MicroBatch
from rlctl.data.vision import is_vision_config
from rlctl.engines import ulysses, varlen
from rlctl.engines.base import ModelSource, TrainEngine, full_logits
from rlctl.engines.modules import _full
from rlctl.engines.savers import HostActivations
from rlctl.engines.sharding import ShardedModel
from rlctl.engines.spec import EngineSpec
from rlctl.engines.vision import dummy_tower, vision_kwargs
from rlctl.engines.vision_prefix import shared_rope_position_ids
from rlctl.errors import UserError
from rlctl.support import JobFacts, refuse

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class FSDPEngine(ShardedModel, TrainEngine):
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
        refuse(JobFacts(method="ppo" if role == "critic" else "grpo", vision=self.vision), "critic_vision")

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
        refuse(JobFacts(precision=spec.precision, dtype=spec.dtype), "pure_bf16_dtype")
        return spec.precision == "bf16" and self.trainable

    def _sharded(self, spec: EngineSpec) -> bool:
        refuse(JobFacts(shard=spec.shard, world=self.world), "no_shard_one_gpu")
        if not spec.shard and self.offload:
            raise UserError("parameter/optimizer offload is FSDP2's CPUOffloadPolicy: keep parallel.shard on for it")
        return spec.shard

    def _sp_groups(self, spec: EngineSpec) -> ulysses.SPGroups | None:
        """The (dp, sp) groups of Ulysses sequence parallelism (None: sp 1)."""
        if spec.sp == 1:
            return None
        c = self.hf_config
        heads = dict(heads=c.num_attention_heads, kv_heads=getattr(c, "num_key_value_heads", None) or 1)
        facts = JobFacts(sp=spec.sp, world=self.world, model=spec.model, vision=is_vision_config(c), **heads)
        refuse(facts, "sp_vision", "sp_size")
        return ulysses.sp_groups(spec.sp, self.device.type)

    def _attn(self, spec: EngineSpec) -> str:
        attn = spec.attn  # None unless the user chose (the plan's attn is a forecast, not an order)
        if spec.sp > 1 and attn not in (None, "sdpa", "flash_attention_2"):
            # rlctl's per-document attention runs inside the all-to-alls: flash-attn's varlen kernel or sdpa
            raise UserError(f"parallel.sp={spec.sp} runs attention per document; set model.attn=sdpa")
        has_flash = importlib.util.find_spec("flash_attn") is not None
        if attn is None:
            return "flash_attention_2" if self.device.type == "cuda" and has_flash else "sdpa"
        if attn == "flash_attention_2" and (self.device.type != "cuda" or not has_flash):
            raise UserError("model.attn=flash_attention_2 needs a GPU and the flash-attn package; use model.attn=sdpa")
        return attn

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
            stack.enter_context(HostActivations(self.device))
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
                flash = self.attn == "flash_attention_2"  # flash-attn's varlen kernel per document
                return ulysses.forward(self.model, mb, self.sp, critic=self.role == "critic", flash=flash)
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
