"""The FSDP2 training engine shared by sft, grpo and ppo.

The engine composes three parts chosen once: a model adapter (:mod:`rlctl.engines.adapters`: a causal LM,
:class:`~rlctl.engines.modules.CriticAdapter` or :class:`~rlctl.engines.vision.VisionAdapter`) that builds,
calls and names the model; the parallel dimensions (:class:`rlctl.engines.dims.ParallelDims`, sp 1 the
trivial grid) with how the model is called over them (:class:`~rlctl.engines.adapters.PlainCalls` or
:class:`~rlctl.engines.ulysses.UlyssesCalls`); and the sharded model itself,
:func:`rlctl.engines.sharding.build_sharded_model` (on meta, LoRA, ``fully_shard`` per decoder layer, the
shards filled from rank 0's weights).

Precision: trained parameters (the master weights) and optimizer states are fp32; on GPU the
forward and backward run in bf16 and gradients are reduced in fp32 (``MixedPrecisionPolicy``); on
CPU everything is fp32. Frozen weights are held in the compute dtype: a frozen model (the reference
policy), and with LoRA the frozen base model (only the adapters, and a critic's value head, are
trained and kept in fp32).

Gradients are SUMMED over ranks (see :mod:`rlctl.engines.base`), clipped by their global norm,
and AdamW steps with a linear warmup then cosine decay to ``min_lr_ratio`` of the peak.

Critic (PPO): ``role="critic"`` builds :class:`~rlctl.engines.modules.CriticModel` (values ``[B, T]`` in fp32).
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

from rlctl.data.vision import is_vision_config
from rlctl.engines import ulysses
from rlctl.engines.adapters import CallContext, ModelAdapter, PlainCalls
from rlctl.engines.base import ModelSource, TrainEngine
from rlctl.engines.dims import ParallelDims, parallel_dims
from rlctl.engines.modules import CriticAdapter, _full
from rlctl.engines.savers import HostActivations
from rlctl.engines.sharding import BuildSpec, Placement, Precision, build_sharded_model
from rlctl.engines.spec import EngineSpec
from rlctl.engines.vision import VisionAdapter
from rlctl.errors import UserError
from rlctl.support import JobFacts, refuse

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
        self.world = dist.get_world_size()
        self.dims = self._parallel_dims(spec)
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

        self.adapter = choose_adapter(role, vision=self.vision)
        # packed rows split per document (rlctl.engines.varlen); VL models: transformers' packed masks instead
        self.varlen = self.adapter.varlen(self.attn)
        flash = self.attn == "flash_attention_2"  # flash-attn's varlen kernel per document
        self.calls = ulysses.UlyssesCalls(self.dims, flash=flash) if self.dims.sp > 1 else PlainCalls()
        self.placement = self._placement()
        self.parts = build_sharded_model(self._build_spec(spec), self.placement)
        self.model = self.parts.root
        self.optimizer = None
        if trainable:
            self._build_optimizer()
        else:
            self.parts.state.requires_grad_(False)
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

    def _parallel_dims(self, spec: EngineSpec) -> ParallelDims:
        """The (dp, sp) grid of Ulysses sequence parallelism (sp 1: every rank a replica)."""
        if spec.sp == 1:
            return parallel_dims(1, self.device.type)
        c = self.hf_config
        heads = dict(heads=c.num_attention_heads, kv_heads=getattr(c, "num_key_value_heads", None) or 1)
        facts = JobFacts(sp=spec.sp, world=self.world, model=spec.model, vision=is_vision_config(c), **heads)
        refuse(facts, "sp_vision", "sp_size")
        return parallel_dims(spec.sp, self.device.type)

    def _attn(self, spec: EngineSpec) -> str:
        attn = spec.attn  # None unless the user chose (the plan's attn is a forecast, not an order)
        refuse(JobFacts(sp=spec.sp, attn=attn), "sp_attn")
        has_flash = importlib.util.find_spec("flash_attn") is not None
        if attn is None:
            return "flash_attention_2" if self.device.type == "cuda" and has_flash else "sdpa"
        if attn == "flash_attention_2" and (self.device.type != "cuda" or not has_flash):
            raise UserError("model.attn=flash_attention_2 needs a GPU and the flash-attn package; use model.attn=sdpa")
        return attn

    def _build_spec(self, spec: EngineSpec) -> BuildSpec:
        return BuildSpec(
            adapter=self.adapter,
            source=self.source,
            hf_config=self.hf_config,
            attn=self.attn,
            lora=spec.lora if self.lora_rank else None,
            train_vision=spec.train_vision,
            seed=spec.seed,
            activation_checkpointing=spec.activation_checkpointing,
            selective_checkpointing=spec.selective_checkpointing,
            install_attention=lambda config: self.calls.install(config, varlen_ok=self.varlen),
        )

    def _placement(self) -> Placement:
        precision = Precision(self.compute_dtype, self.param_dtype, self.frozen_dtype, self.pure_bf16)
        return Placement(self.device, self.dims, self.sharded, self.offload, self.trainable, precision)

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
        if not self.sharded and self.placement.precision.mixed:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.compute_dtype))
        return stack

    def _context(self) -> CallContext:
        return CallContext(self.device, self.varlen, self.sharded and self.world > 1, self._memory_context)

    def forward(self, input_ids, position_ids, attention_mask=None) -> torch.Tensor:
        return self.calls.forward(self.adapter, self.model, input_ids, position_ids, attention_mask, self._context())

    def forward_micro(self, mb) -> torch.Tensor:
        """One micro-batch's output, with as little wasted work as the layout allows (the adapter's
        :meth:`~rlctl.engines.adapters.ModelAdapter.forward_micro`): packed and shared-prefix rows attend
        per document, and an RL micro-batch's logits are computed only where the loss reads them
        (``logits_to_keep``); under sp, each rank its shard of the sequence (:mod:`rlctl.engines.ulysses`)."""
        return self.calls.forward_micro(self.adapter, self.model, mb, self._context())

    @property
    def shares_prefix(self) -> bool:
        """Shared-prefix micro-batches run where packed rows attend per block (sdpa through
        :mod:`rlctl.engines.varlen`); eager attention would add their boolean mask instead of applying
        it, and flash-attention's varlen kernels cannot take it: those keep the packed rows. VL models (varlen
        off) run them with sdpa and the blocks' dense mask; a critic never (its values cover every position)."""
        return self.adapter.shares_prefix(varlen=self.varlen, attn=self.attn)

    # ------------------------------------------------------------------ data-parallel coordinates

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.dims.dp_group

    @property
    def mp_size(self) -> int:
        """The SP ranks split each sequence of the micro-batches they share."""
        return self.dims.sp

    @property
    def mp_group(self) -> dist.ProcessGroup | None:
        return self.dims.sp_group

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
        state = {"model": get_model_state_dict(self.parts.state)}
        if self.trainable:
            state["optim"] = get_optimizer_state_dict(self.parts.state, self.optimizer)
            state["scheduler"] = {"step": self.global_step}
        return state

    def load_state_dict(self, state: dict) -> None:
        self._reshard()
        set_model_state_dict(self.parts.state, state["model"])
        if self.trainable and "optim" in state:
            set_optimizer_state_dict(self.parts.state, self.optimizer, state["optim"])
            for group in self.optimizer.param_groups:  # checkpoints from before fused AdamW say fused=None
                group["fused"] = True
            self.global_step = int(state["scheduler"]["step"])

    def lora_info(self) -> dict | None:
        if not self.lora_rank:
            return None
        cfg = self.adapter.lora_host(self.parts.state).peft_config["default"].to_dict()
        return {
            k: (sorted(v) if isinstance(v, set) else v)
            for k, v in cfg.items()
            if k in ("r", "lora_alpha", "lora_dropout", "target_modules", "bias")
        }

    def save_lora_config(self, out_dir: str | Path) -> None:
        self.adapter.lora_host(self.parts.state).peft_config["default"].save_pretrained(str(out_dir))

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

        for module, prefix in self.adapter.export_modules(self.model):  # a critic: its backbone, its value head
            yield from walk(module, prefix)


def choose_adapter(role: str, *, vision: bool) -> ModelAdapter:
    """The model adapter of a role: a critic's value model, a VL model, or a causal LM."""
    if role == "critic":
        return CriticAdapter()
    return VisionAdapter() if vision else ModelAdapter()
