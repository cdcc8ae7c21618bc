"""What an engine is asked to build: :class:`EngineSpec` (with its :class:`OptimizerSpec` and
:class:`LoraSpec`), read once from the resolved run config.

The planner fills every None and 0 size of the config (:func:`rlctl.plan.apply_plan`) before a job
starts and the run directory keeps that resolved config; :meth:`EngineSpec.from_config` reads it here, in one
place, and the engines read typed fields only: they never see the run config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rlctl import names

if TYPE_CHECKING:
    from rlctl.config import RunConfig

BACKENDS = names.BACKENDS
DEVICES = names.choices(names.Device)
DTYPES = names.choices(names.Dtype)


class UnresolvedConfig(RuntimeError):
    """An internal error: an engine was given a config the plan has not resolved (a None is left)."""


@dataclass(frozen=True)
class OptimizerSpec:
    """AdamW and its schedule: linear warmup over ``warmup_ratio`` of the steps, then cosine decay to
    ``min_lr_ratio`` of the peak ``lr`` (:func:`rlctl.engines.schedule.lr_factor`); gradients clipped to
    the global norm ``grad_clip`` (0: no clipping)."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    warmup_ratio: float = 0.03
    min_lr_ratio: float = 0.1

    @classmethod
    def from_config(cls, cfg: RunConfig) -> OptimizerSpec:
        """``train.*``'s optimizer settings (the PPO critic replaces ``lr`` with ``algo.critic_lr``)."""
        t = cfg.train
        return cls(
            lr=t.lr,
            weight_decay=t.weight_decay,
            betas=(float(t.betas[0]), float(t.betas[1])),
            grad_clip=t.grad_clip,
            warmup_ratio=t.warmup_ratio,
            min_lr_ratio=t.min_lr_ratio,
        )

    def replace(self, **changes) -> OptimizerSpec:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters on the trained model (``rank`` 0: full fine-tuning)."""

    rank: int = 0
    alpha: float = 0.0  # 0 = 2 x rank
    dropout: float = 0.0
    targets: str = "all-linear"  # all-linear or a comma list such as q_proj,v_proj

    @classmethod
    def from_config(cls, cfg: RunConfig) -> LoraSpec:
        lc = cfg.lora
        return cls(rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout, targets=lc.targets)

    @property
    def scaled_alpha(self) -> float:
        """peft's ``lora_alpha``: ``alpha``, or 2 x rank when it is 0."""
        return self.alpha or 2 * self.rank

    @property
    def target_modules(self) -> str | list[str]:
        """peft's ``target_modules``: "all-linear" or the listed module names."""
        if self.targets in ("", "all-linear"):
            return "all-linear"
        return [t.strip() for t in self.targets.split(",") if t.strip()]


@dataclass(frozen=True)
class EngineSpec:
    """How to build a training engine: the model, placement, precision, parallel layout, memory savings,
    the optimizer and LoRA.

    ``attn`` may stay None: the engine picks flash_attention_2 where flash-attn is installed on a GPU
    and sdpa otherwise, at run time (the planner leaves ``model.attn`` as it is).
    """

    backend: str = "fsdp"  # fsdp | megatron
    device: str = "cpu"  # cpu | cuda
    dtype: str = "fp32"  # bf16 | fp16 | fp32 (the engines train in bf16 or fp32)
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: int = 1  # Ulysses sequence parallel size: each sequence split over sp ranks (FSDP engine)
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    offload_params: bool = False
    offload_optimizer: bool = False
    attn: str | None = None  # sdpa | eager | flash_attention_2; None: the engine picks at run time
    micro_batch_size: int = 1
    precision: str = "mixed"  # mixed | bf16 (pure bf16 weights, gradients and AdamW states; FSDP engine)
    selective_checkpointing: bool = False  # recompute each decoder layer's MLP in the backward (FSDP engine)
    offload_activations: bool = False  # tensors saved for the backward go to (pinned) host memory (FSDP engine)
    shard: bool = True  # FSDP2 wrappers; False (one process only): the plain module, no gather buffers
    model: str = ""  # model.name: a local HF directory, catalog name or hub id (rlctl.engines.base.model_source)
    random_init: bool = False  # random weights from the model's config (nothing is read)
    seed: int = 42  # train.seed: random weights, LoRA's A and a critic's value head are drawn from it
    compile: bool = False  # train.compile (no engine supports it yet)
    max_seq_len: int = 0  # the longest sequence the run feeds (0: unknown); the megatron engine checks windows
    train_vision: bool = False  # model.train_vision: a VL model's vision tower is trained (else frozen)
    optimizer: OptimizerSpec = OptimizerSpec()
    lora: LoraSpec = LoraSpec()

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise UnresolvedConfig(f"EngineSpec.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device not in DEVICES:
            raise UnresolvedConfig(f"EngineSpec.device must be one of {DEVICES}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise UnresolvedConfig(f"EngineSpec.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.precision not in names.choices(names.Precision):
            raise UnresolvedConfig(f"EngineSpec.precision must be mixed or bf16, got {self.precision!r}")
        for name in ("tp", "pp", "cp", "ep", "sp", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise UnresolvedConfig(f"EngineSpec.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, cfg: RunConfig) -> EngineSpec:
        """The spec of a RESOLVED run config (after ``rlctl.plan.apply_plan``); UnresolvedConfig where a
        None (or a 0 size) is left, which is a bug of the caller, not the user's input."""
        par = cfg.parallel

        def flag(name: str) -> bool:
            value = getattr(par, name)
            if not isinstance(value, bool):
                raise UnresolvedConfig(f"parallel.{name} is {value!r}, not true/false: the plan was not applied")
            return value

        for key, value in (
            ("parallel.backend", par.backend),
            ("hardware.device", cfg.hardware.device),
            ("model.dtype", cfg.model.dtype),
        ):
            if value is None:
                raise UnresolvedConfig(f"{key} is {value!r}: the plan was not applied to the config")
        for key, value in (
            ("parallel.tp", par.tp),
            ("parallel.pp", par.pp),
            ("parallel.ep", par.ep),
            ("parallel.sp", par.sp),
        ):
            if value is None or value < 1:
                raise UnresolvedConfig(f"{key} is {value}: the plan was not applied to the config")
        return cls(
            backend=par.backend,
            device=cfg.hardware.device,
            dtype=cfg.model.dtype,
            tp=par.tp,
            pp=par.pp,
            cp=max(1, par.cp),
            ep=par.ep,
            sp=par.sp,
            sequence_parallel=flag("sequence_parallel"),
            activation_checkpointing=flag("activation_checkpointing"),
            offload_params=flag("offload_params"),
            offload_optimizer=flag("offload_optimizer"),
            attn=cfg.model.attn,
            micro_batch_size=cfg.train.micro_batch_size or 1,
            precision=cfg.train.precision,
            # the memory options below default to off (None the plan left alone: the engine's default)
            selective_checkpointing=par.selective_checkpointing is True,
            offload_activations=par.offload_activations is True,
            shard=par.shard is not False,
            **cls.run_fields(cfg),
        )

    @staticmethod
    def run_fields(cfg: RunConfig) -> dict:
        """The fields that come from the model, train, lora and rollout sections (none is planned)."""
        r = cfg.rollout
        return {
            "model": cfg.model.name,
            "random_init": cfg.model.random_init,
            "seed": cfg.train.seed,
            "compile": cfg.train.compile,
            "max_seq_len": max(cfg.train.max_len, r.max_prompt_len + r.max_response_len),
            "train_vision": cfg.model.train_vision,
            "optimizer": OptimizerSpec.from_config(cfg),
            "lora": LoraSpec.from_config(cfg),
        }

    def replace(self, **changes) -> EngineSpec:
        """A copy with ``changes`` (checked like a new spec)."""
        return dataclasses.replace(self, **changes)
