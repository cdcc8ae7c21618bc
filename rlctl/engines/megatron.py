"""The Megatron training engine: megatron-core's ``GPTModel`` with tensor, pipeline and data parallelism.

The planner picks ``backend=megatron`` for models too large for FSDP alone (14B-72B dense). The
recipes build their engines with :func:`rlctl.engines.build_engine`, which calls :func:`build_engine`
here for that backend; the launch command is the same torchrun command (the environment of
:func:`rlctl.engines.megatron_parallel.megatron_env` added).

How a model is built (every rank, see :class:`MegatronEngine`):

1. ``parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp,
   expert_model_parallel_size=ep)`` once per process (the actor and the reference share it);
2. a ``GPTModel`` for this rank's pipeline stage from the HF config (:func:`transformer_config`):
   RMSNorm, SwiGLU, RoPE with the model's theta, GQA, QKV bias (Qwen2), q/k norm (Qwen3), tied
   embeddings, the vocabulary padded to a multiple of :data:`VOCAB_MULTIPLE` (the same for any tp up
   to 8, so checkpoints reshard across tp). Transformer Engine's layer spec on GPU when installed,
   megatron-core's local spec otherwise. When pp does not divide the layers the last stage holds
   fewer (``num_layers_in_last_pipeline_stage``, :func:`rlctl.engines.megatron_parallel.pipeline_stages`);
3. the rank reads only its slices of the HF safetensors (:func:`stage_shard`), and every parameter
   must be set;
4. trainable models are wrapped in megatron-core's ``DistributedDataParallel`` and get its
   ``DistributedOptimizer`` (AdamW; bf16 parameters with fp32 master weights and fp32 gradient
   reduction on GPU). With the plan's ``offload_optimizer`` the master weights, gradient copies and
   AdamW states live on the CPU, which steps the optimizer (:func:`optimizer_settings`).

Gradients are SUMMED over data-parallel ranks (``calculate_per_token_loss=True``: no averaging by
the DP size nor by the number of micro-batches), as :mod:`rlctl.engines.base` requires. Tensor- and
pipeline-parallel ranks of one data-parallel replica must be fed the same micro-batches
(:attr:`MegatronEngine.dp_rank` / :attr:`~MegatronEngine.dp_size` say which share a rank takes;
sums over the data go over :attr:`~MegatronEngine.dp_group`).

Steps: :meth:`MegatronEngine.forward_backward` (what the recipes call) runs megatron-core's pipeline
schedule (``get_forward_backward_func``) over all micro-batches of a step, for any pp;
:meth:`~MegatronEngine.forward` / :meth:`~MegatronEngine.backward` work when pp = 1.

Packed rows (several documents in one row, positions restarting at 0) are unpacked into one padded
row per document before the model (:func:`unpack_rows`), because megatron-core's RoPE numbers
positions 0..L-1 per row; logits are packed back. Logits come back gathered over TP and cut to the HF
vocabulary.

Checkpoints: :meth:`~MegatronEngine.save_checkpoint` / :meth:`~MegatronEngine.load_checkpoint` use
megatron-core's ``dist_checkpointing`` (torch_dist): every tensor is stored as one global tensor, so a
checkpoint loads at another tp/pp, and ``rlctl convert megatron-to-hf`` reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlctl.config import RunConfig
from rlctl.engines.base import (
    ROLES,
    LossFn,
    ModelSource,
    TrainEngine,
    detached,
    model_source,
)
from rlctl.engines.megatron_parallel import (
    CUDA_MAX_CONNECTIONS,
    check_megatron_layout,
    layer_stages,
    pipeline_stages,
)
from rlctl.errors import UserError
from rlctl.formats.megatron_layout import (
    MegatronLayoutConfig,
    megatron_shard_for_rank,
    megatron_to_hf,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
INSTALL_HINT = "pip install 'rlctl[megatron]' (or: pip install --no-deps megatron-core)"
#: The padded vocabulary is a multiple of this for every tp dividing it (Megatron-LM pads to 128 * tp,
#: which changes with tp and would make checkpoints tp-specific).
VOCAB_MULTIPLE = 1024
#: Names of the local (non-Transformer-Engine) spec -> the layout's (TE) names, for the fused norms.
_LOCAL_TO_LAYOUT = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


def require_megatron_core() -> None:
    """UserError naming the install command when megatron-core is missing."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise UserError(
            f"parallel.backend=megatron needs megatron-core, which is not installed: {INSTALL_HINT}; "
            f"or use parallel.backend=fsdp"
        )


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


# ---------------------------------------------------------------------------------------------
# From the HF config to megatron-core's config


def layout_config(hf: Mapping[str, Any], tp: int) -> MegatronLayoutConfig:
    """The weight layout of an HF config, with the vocabulary padding rlctl's engine uses for ``tp``."""
    cfg = MegatronLayoutConfig.from_hf_config(hf)
    if VOCAB_MULTIPLE % tp == 0:
        cfg = dataclasses.replace(cfg, make_vocab_size_divisible_by=VOCAB_MULTIPLE // tp)
    return cfg


def _rope(hf: Mapping[str, Any]) -> tuple[float, float | None]:
    """(rope theta, llama3 scaling factor or None); UserError for RoPE scalings megatron-core lacks."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "default":
        return theta, None
    llama3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if kind == "llama3" and all(float(params.get(k, v)) == v for k, v in llama3.items()):
        return theta, float(params["factor"])
    raise UserError(
        f"RoPE scaling {kind!r} ({params}) is not supported by the megatron engine (only llama3 "
        f"scaling with low/high freq factors 1/4 and 8192 original positions); use parallel.backend=fsdp"
    )


def _check_sliding_window(hf: Mapping[str, Any], max_seq_len: int) -> None:
    window = hf.get("sliding_window")
    active = window and (hf.get("model_type") == "mistral" or hf.get("use_sliding_window"))
    if active and window < max_seq_len:
        raise UserError(
            f"the model attends within a sliding window of {window} tokens, which the megatron "
            f"engine does not implement; keep sequences <= {window} tokens or use parallel.backend=fsdp"
        )


def transformer_config(
    hf: Mapping[str, Any],
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    dtype: torch.dtype = torch.float32,
    cuda: bool = False,
    recompute: bool = False,
):
    """megatron-core's ``TransformerConfig`` for an HF Qwen2/Qwen2.5/Qwen3/Llama/Mistral config."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = MegatronLayoutConfig.from_hf_config(hf)
    bf16 = dtype == torch.bfloat16
    te = cuda and have_transformer_engine()
    kwargs: dict[str, Any] = {}
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    stages = pipeline_stages(layout.num_layers, pp)
    if stages[-1] != stages[0]:  # pp does not divide the layers: even stages, then a shorter last one
        kwargs["num_layers_in_last_pipeline_stage"] = stages[-1]
    return TransformerConfig(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_kv_heads,
        kv_channels=layout.head_dim,
        ffn_hidden_size=layout.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        qk_layernorm=layout.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)),
        # always: megatron-core marks TP-split weights (``tensor_model_parallel``) only while initialising
        # them, and without the mark the grad norm (and so clipping) counts one TP rank's shard only
        perform_initialization=True,
        use_cpu_initialization=not cuda,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=bf16,
        # rlctl's contract: per-rank losses are shares of one global loss; gradients are summed.
        calculate_per_token_loss=True,
        variable_seq_lengths=True,  # micro-batches of any length through the pipeline
        moe_token_dispatcher_type="alltoall",  # (no experts here; the default one rejects variable lengths)
        # fused kernels exist on GPU only (Transformer Engine / apex / torch.jit on CUDA)
        apply_rope_fusion=te,
        masked_softmax_fusion=te,
        bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda,
        persist_layer_norm=cuda,
        gradient_accumulation_fusion=False,
        **kwargs,
    )


def layer_spec(hf: Mapping[str, Any], *, cuda: bool):
    """Transformer Engine's layer spec on GPU when installed, megatron-core's local spec otherwise."""
    from megatron.core.models.gpt import gpt_layer_specs

    qk_norm = MegatronLayoutConfig.from_hf_config(hf).qk_norm
    if cuda and have_transformer_engine():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")


def build_gpt_model(hf: Mapping[str, Any], config, *, tp: int, cuda: bool):
    """This pipeline stage's ``GPTModel`` (parallel_state must be initialised)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from rlctl.formats.megatron_layout import padded_vocab_size

    layout = layout_config(hf, tp)
    theta, llama3_factor = _rope(hf)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(hf, cuda=cuda),
        vocab_size=padded_vocab_size(layout, tp),
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=theta,
        rope_scaling=llama3_factor is not None,
        rope_scaling_factor=llama3_factor or 8.0,
    )


def layout_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under the layout's names (local-spec norms renamed to the TE names)."""
    out = {}
    for name, p in model.named_parameters():
        for local, layout in _LOCAL_TO_LAYOUT.items():
            if name.endswith(local):
                name = name[: -len(local)] + layout
        out[name] = p
    return out


_LAYER0 = "decoder.layers.0."


def _in_stage(name: str, local: int) -> str:
    """A one-layer stage's name (``decoder.layers.0.*``) as layer ``local`` of a real stage."""
    return f"decoder.layers.{local}." + name[len(_LAYER0) :] if name.startswith(_LAYER0) else name


def stage_shard(
    get_hf_tensor, layout: MegatronLayoutConfig, *, tp: int, pp: int, tp_rank: int, pp_rank: int
) -> dict[str, torch.Tensor]:
    """Rank ``(tp_rank, pp_rank)``'s Megatron state dict for any pipeline split (:func:`pipeline_stages`).

    The layout numbers even stages only, so each layer of this stage is read as the one layer of a
    stage of a ``pp = num_layers`` split and renumbered; layer 0 brings the embedding and the last
    layer the final norm and output layer, which are on the first and last stage in any split.
    """
    out: dict[str, torch.Tensor] = {}
    for layer, (stage, local) in enumerate(layer_stages(layout.num_layers, pp)):
        if stage == pp_rank:
            part = megatron_shard_for_rank(get_hf_tensor, layout, tp, layout.num_layers, tp_rank, layer)
            out.update((_in_stage(name, local), t) for name, t in part.items())
    if layout.tied_embeddings and pp == 1:  # one stage: the output layer IS the embedding
        out.pop("output_layer.weight", None)
    return out


def load_hf_weights(
    model: torch.nn.Module, get_hf_tensor, layout: MegatronLayoutConfig, *, tp: int, pp: int, tp_rank: int, pp_rank: int
) -> None:
    """Copy rank ``(tp_rank, pp_rank)``'s slices of the HF tensors into ``model``; every parameter must be set."""
    shard = stage_shard(get_hf_tensor, layout, tp=tp, pp=pp, tp_rank=tp_rank, pp_rank=pp_rank)
    params = layout_state(model)
    missing, unexpected = sorted(set(params) - set(shard)), sorted(set(shard) - set(params))
    if missing or unexpected:
        raise RuntimeError(
            f"rank tp {tp_rank} pp {pp_rank}: the GPTModel and the weight layout disagree: "
            f"parameters without weights {missing[:4]}, weights without parameters {unexpected[:4]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            if tuple(p.shape) != tuple(shard[name].shape):
                raise RuntimeError(f"{name}: parameter {tuple(p.shape)} vs weights {tuple(shard[name].shape)}")
            p.copy_(shard[name])


# ---------------------------------------------------------------------------------------------
# Packed rows <-> one padded row per document


@dataclasses.dataclass
class Unpacked:
    """Documents of a [B, T] batch laid out one per row, ``tokens`` [N, L] (right-padded with 0)."""

    tokens: torch.Tensor
    index: torch.Tensor  # [B*T] flat position in tokens (N*L) of each input position
    shape: tuple[int, int]

    def repack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, L, ...] -> [B, T, ...] in the input's layout (differentiable)."""
        return x.reshape(-1, *x.shape[2:])[self.index].reshape(*self.shape, *x.shape[2:])


def unpack_rows(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    multiple: int = 1,
) -> Unpacked:
    """Split rows at every position-id restart (pos[t] != pos[t-1] + 1) into one row per document.

    Padding (``attention_mask`` 0) never starts a document: it stays at the end of the one before.
    ``L`` is rounded up to ``multiple`` (sequence parallelism splits it over tp).
    """
    b, t = input_ids.shape
    pos = position_ids.expand(b, t)
    starts = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if attention_mask is not None:
        starts[:, 1:] &= attention_mask[:, 1:].bool()
    flat = starts.flatten()
    segment = torch.cumsum(flat.long(), 0) - 1
    first = torch.nonzero(flat).flatten()
    offset = torch.arange(b * t, device=input_ids.device) - first[segment]
    width = int(offset.max()) + 1
    width = -(-width // multiple) * multiple
    tokens = input_ids.new_zeros(first.numel(), width)
    tokens[segment, offset] = input_ids.flatten()
    return Unpacked(tokens, segment * width + offset, (b, t))


# ---------------------------------------------------------------------------------------------
# The engine


def optimizer_settings(cfg: RunConfig, *, lr: float, dtype: torch.dtype, offload: bool) -> dict[str, Any]:
    """megatron-core ``OptimizerConfig`` fields: AdamW over the distributed optimizer (fp32 master weights
    beside bf16 parameters), clipping by ``train.grad_clip``. ``offload``: all optimizer states and the
    step on the CPU (``optimizer_cpu_offload`` with fraction 1.0, which needs the precision-aware optimizer)."""
    t = cfg.train
    settings: dict[str, Any] = {
        "optimizer": "adam",
        "lr": lr,
        "weight_decay": t.weight_decay,
        "adam_beta1": float(t.betas[0]),
        "adam_beta2": float(t.betas[1]),
        "adam_eps": 1e-8,
        "clip_grad": t.grad_clip if t.grad_clip > 0 else 1e30,  # a huge clip still reports the norm
        "bf16": dtype == torch.bfloat16,
        "params_dtype": dtype,
        "use_distributed_optimizer": True,
    }
    if offload:
        settings.update(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, use_precision_aware_optimizer=True)
    return settings


def _plan_get(plan, key: str, default=None):
    return plan.get(key, default) if isinstance(plan, Mapping) else getattr(plan, key, default)


def init_model_parallel(tp: int, pp: int, cp: int = 1, ep: int = 1, *, seed: int = 0, cuda: bool = False) -> None:
    """Start megatron-core's parallel state (once per process; a second engine must use the same sizes)."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if have != (tp, pp, cp, ep):
            raise RuntimeError(f"megatron parallel state already set to tp/pp/cp/ep {have}, not {(tp, pp, cp, ep)}")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    if cuda:  # TP weight init and dropout draw from megatron's CUDA RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


class MegatronEngine(TrainEngine):
    """One model split by megatron-core (TP x PP, replicated over DP), with its optimizer when trainable.

    The constructor mirrors :class:`rlctl.engines.fsdp.FSDPEngine` (same arguments); plan fields used:
    device, dtype, tp, pp, cp, ep, sequence_parallel, activation_checkpointing, offload_optimizer.
    """

    backend = "megatron"

    def __init__(
        self,
        cfg: RunConfig,
        plan,
        *,
        role: str = "actor",
        trainable: bool = True,
        total_steps: int = 0,
        lr: float | None = None,
        source: ModelSource | None = None,
        lora: bool | None = None,
    ):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if role == "critic":
            raise UserError(
                "the PPO critic is not supported by the megatron engine yet; "
                "use method grpo, or parallel.backend=fsdp for ppo"
            )
        if (trainable if lora is None else lora) and cfg.lora.rank > 0:
            raise UserError("LoRA is not supported by the megatron engine; set lora.rank=0 or parallel.backend=fsdp")
        if cfg.train.compile:
            raise UserError("train.compile is not supported by the megatron engine; set train.compile=false")
        self.cuda = _plan_get(plan, "device", "cpu") == "cuda"
        if _plan_get(plan, "offload_params"):
            raise UserError(
                "parallel.offload_params (weights on the CPU between phases) is not supported by the "
                "megatron engine yet; set parallel.offload_params=false (parallel.offload_optimizer=true "
                "keeps the optimizer on the CPU) or use more GPUs"
            )
        self.offload_optimizer = bool(_plan_get(plan, "offload_optimizer")) and trainable and self.cuda
        if self.offload_optimizer and not have_transformer_engine():
            raise UserError(
                "parallel.offload_optimizer on the megatron engine needs Transformer Engine "
                "(megatron-core's precision-aware optimizer): pip install 'transformer-engine[pytorch]', "
                "or set parallel.offload_optimizer=false"
            )
        require_megatron_core()
        from megatron.core import parallel_state

        self.cfg, self.role, self.trainable = cfg, role, trainable
        self.total_steps = total_steps
        self.peak_lr = cfg.train.lr if lr is None else lr
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        name = _plan_get(plan, "dtype") or cfg.model.dtype
        name = ("bf16" if self.cuda else "fp32") if name in (None, "auto") else name
        if name not in DTYPES:
            raise UserError(f"the megatron engine trains in bf16 or fp32, not {name}; set model.dtype=bf16")
        self.compute_dtype = DTYPES[name]
        self.tp, self.pp = int(_plan_get(plan, "tp", 1) or 1), int(_plan_get(plan, "pp", 1) or 1)
        cp, ep = int(_plan_get(plan, "cp", 1) or 1), int(_plan_get(plan, "ep", 1) or 1)
        self.sequence_parallel = bool(_plan_get(plan, "sequence_parallel", False)) and self.tp > 1

        self.source = source or model_source(cfg.model.name, random_init=cfg.model.random_init)
        self.hf_config = self.source.load_config()
        hf = self.hf_config.to_dict()
        self.layout = layout_config(hf, self.tp)
        check_megatron_layout(self.layout, world=dist.get_world_size(), tp=self.tp, pp=self.pp, cp=cp, ep=ep)
        _rope(hf)
        _check_sliding_window(hf, max(cfg.train.max_len, cfg.rollout.max_prompt_len + cfg.rollout.max_response_len))
        if self.cuda and (self.tp > 1 or self.sequence_parallel) and os.environ.get(CUDA_MAX_CONNECTIONS) != "1":
            print(
                f"warning: {CUDA_MAX_CONNECTIONS}=1 is not set; megatron-core's TP communication overlap "
                f"needs it (rlctl's launcher sets it)",
                file=sys.stderr,
                flush=True,
            )

        init_model_parallel(self.tp, self.pp, cp, ep, seed=cfg.train.seed, cuda=self.cuda)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.config = transformer_config(
            hf,
            tp=self.tp,
            pp=self.pp,
            cp=cp,
            ep=ep,
            sequence_parallel=self.sequence_parallel,
            dtype=self.compute_dtype,
            cuda=self.cuda,
            recompute=trainable and bool(_plan_get(plan, "activation_checkpointing", False)),
        )
        torch.manual_seed(cfg.train.seed)
        self.gpt = build_gpt_model(hf, self.config, tp=self.tp, cuda=self.cuda)
        if self.cuda:
            self.gpt.cuda(self.device)
        if not self.source.random_init:
            self._load_hf()
        self.global_step = 0
        self.optimizer = None
        self.model: torch.nn.Module = self.gpt
        if trainable:
            self._wrap_ddp_and_optimizer()
        else:
            self.gpt.requires_grad_(False)
        self.train(trainable)

    # ------------------------------------------------------------------ setup

    def _load_hf(self) -> None:
        from rlctl.formats.safetensors import HFSafetensors

        load_hf_weights(
            self.gpt,
            HFSafetensors(Path(self.source.path)),
            self.layout,
            tp=self.tp,
            pp=self.pp,
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
        )

    def _wrap_ddp_and_optimizer(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=True,
            overlap_grad_reduce=False,
            check_for_nan_in_grad=True,
        )
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=self.gpt)
        if self.source.random_init:
            self.model.broadcast_params()  # the same random weights on every data-parallel replica
        settings = optimizer_settings(
            self.cfg, lr=self.peak_lr * self._lr_factor(0), dtype=self.compute_dtype, offload=self.offload_optimizer
        )
        self.optimizer = get_megatron_optimizer(OptimizerConfig(**settings), [self.model])
        # the pipeline schedule syncs gradients through these hooks; no per-token scaling (the
        # recipe's loss is already normalised by the global token count)
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = lambda models, num_tokens=None, **kw: finalize_model_grads(
            models, None, **kw
        )

    # ------------------------------------------------------------------ training

    def _lr_factor(self, step: int) -> float:
        from rlctl.engines.fsdp import lr_factor

        t = self.cfg.train
        return lr_factor(step, max(1, self.total_steps), t.warmup_ratio, t.min_lr_ratio)

    @property
    def lr(self) -> float:
        return self.peak_lr * self._lr_factor(self.global_step)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode and self.trainable)

    def _run(self, model, unpacked: Unpacked) -> torch.Tensor:
        """This stage of the model on unpacked rows: hidden states, or on the last stage the logits over
        the padded vocabulary [N, L, V'] (gathered over TP)."""
        n, width = unpacked.tokens.shape
        positions = torch.arange(width, device=self.device).expand(n, width)
        return model(unpacked.tokens, positions, attention_mask=self._causal_mask(width), runtime_gather_output=True)

    def _causal_mask(self, width: int) -> torch.Tensor | None:
        """megatron-core builds its causal mask on CUDA; on CPU (tests) it must be passed (True = hidden)."""
        if self.cuda:
            return None
        return torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)[None, None]

    def _unpack(self, input_ids, position_ids, attention_mask=None) -> Unpacked:
        return unpack_rows(
            input_ids.to(self.device),
            position_ids.to(self.device),
            None if attention_mask is None else attention_mask.to(self.device),
            multiple=self.tp if self.sequence_parallel else 1,
        )

    def _single_stage(self, what: str) -> None:
        if self.pp > 1:
            raise RuntimeError(f"MegatronEngine.{what} needs pp=1; with pipeline parallelism use forward_backward()")

    def forward(self, input_ids, position_ids, attention_mask=None) -> torch.Tensor:
        """Logits [B, T, V] over the HF vocabulary (pp=1 only; gathered over TP)."""
        self._single_stage("forward")
        unpacked = self._unpack(input_ids, position_ids, attention_mask)
        return unpacked.repack(self._run(self.model, unpacked)[..., : self.layout.vocab_size])

    def backward(self, loss: torch.Tensor, *, sync: bool = True) -> None:
        """Accumulate gradients (pp=1); on ``sync`` reduce them over DP (and TP for sequence-parallel norms)."""
        if not self.trainable:
            raise RuntimeError(f"the {self.role} engine is frozen")
        self._single_stage("backward")
        loss.backward()
        if sync:
            self.config.finalize_model_grads_func([self.model])

    def forward_backward(
        self, micro_batches: Sequence[Any], loss_fn: LossFn, *, forward_only: bool = False
    ) -> list[Any]:
        """Run ``micro_batches`` through megatron-core's pipeline schedule (any pp); collective over the
        model-parallel group. The contract of :meth:`TrainEngine.forward_backward`: ``loss_fn(logits
        [B, T, V], mb) -> (loss, result)`` runs on the last pipeline stage, and its results are sent to
        the other stages, so every rank gets them. Training leaves the gradients reduced over DP.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not forward_only and not self.trainable:
            raise RuntimeError(f"the {self.role} engine is frozen")
        unpacked = [
            self._unpack(mb.input_ids, mb.position_ids, getattr(mb, "attention_mask", None)) for mb in micro_batches
        ]
        data = iter(zip(micro_batches, unpacked))

        def step_fn(data_iterator, model):
            mb, up = next(data_iterator)
            return self._run(model, up), partial(loss_func, mb, up)

        def loss_func(mb, up, output, non_loss_data=False):
            loss, result = loss_fn(up.repack(output[..., : self.layout.vocab_size]), mb)
            if non_loss_data:  # forward_only
                return detached(result)
            # (calculate_per_token_loss: the schedule neither divides by this count nor by the micro-batches)
            return loss, torch.ones((), dtype=torch.int, device=self.device), {"result": detached(result)}

        with torch.set_grad_enabled(not forward_only):
            results = get_forward_backward_func()(  # (shapes are sent between stages: variable_seq_lengths)
                forward_step_func=step_fn,
                data_iterator=data,
                model=[self.model],
                num_microbatches=len(micro_batches),
                seq_length=max((up.tokens.shape[1] for up in unpacked), default=1),
                micro_batch_size=max((up.tokens.shape[0] for up in unpacked), default=1),
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )
        return self._from_last_stage([r if forward_only else r["result"] for r in results])

    def _from_last_stage(self, results: list[Any]) -> list[Any]:
        """The last pipeline stage's results on every stage of the pipeline."""
        if self.pp == 1:
            return results
        from megatron.core import parallel_state

        box = [_moved(results, "cpu") if parallel_state.is_pipeline_last_stage() else None]
        dist.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
            device=self.device,
        )
        return _moved(box[0], self.device)

    # ------------------------------------------------------------------ data-parallel coordinates

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @property
    def mp_size(self) -> int:
        return self.tp * self.pp

    @property
    def mp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state

        return parallel_state.get_model_parallel_group()

    def step(self) -> float:
        """Clip, step the distributed optimizer at the current lr, zero gradients; the global grad norm."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        _, grad_norm, _ = self.optimizer.step()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.global_step += 1
        return float(grad_norm) if grad_norm is not None else float("nan")

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """megatron-core's sharded state dict {"model", "optimizer", "scheduler"} for ``dist_checkpointing``."""
        return self._sharded_state(is_loading=False)

    def _sharded_state(self, *, is_loading: bool) -> dict:
        model_state = self.gpt.sharded_state_dict()  # the GPTModel's names, without DDP's "module." prefix
        state = {"model": model_state}
        if self.trainable:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
            )
            state["scheduler"] = {"step": self.global_step}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``dist_checkpointing.load`` returned for :meth:`state_dict`."""
        self.gpt.load_state_dict(state["model"])
        if self.trainable and "optimizer" in state:
            with _torch_adam_load_fix(self.optimizer):
                self.optimizer.load_state_dict(state["optimizer"])
            self.global_step = int(state["scheduler"]["step"])

    def save_checkpoint(self, path: str | Path) -> None:
        """Write model (+ optimizer, schedule) as a torch_dist dist checkpoint into ``path`` (collective)."""
        from megatron.core import dist_checkpointing

        Path(path).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(is_loading=False), str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint`, at any tp/pp (collective)."""
        from megatron.core import dist_checkpointing

        if not (Path(path) / "metadata.json").is_file():
            raise UserError(
                f"{path} is not a megatron-core dist checkpoint (no metadata.json); "
                f"was it saved with parallel.backend=fsdp?"
            )
        if self.trainable:
            _init_torch_adam_state(self.optimizer)
        self.load_state_dict(dist_checkpointing.load(self._sharded_state(is_loading=True), str(path)))

    # ------------------------------------------------------------------ full weights

    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor on this engine's device) for every weight, on every rank, layer by layer.

        Each tensor is gathered over TP and sent from its pipeline stage to the others, one at a time.
        As in :func:`stage_shard`, every layer is read as the one layer of a ``pp = num_layers`` split.
        """
        gather = _StageGather(layout_state(self.gpt), self.tp, self.pp, self.device, self.compute_dtype)
        where = layer_stages(self.layout.num_layers, self.pp)

        def get(tp_rank: int, layer: int, name: str) -> torch.Tensor:
            stage, local = where[layer]
            return gather(tp_rank, stage, _in_stage(name, local))

        for name, t in megatron_to_hf(get, self.layout, self.tp, self.layout.num_layers):
            yield name, t.to(dtype) if dtype is not None else t

    def export_hf(self, out_dir: str | Path, meta_dir: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Write the full model as a HF directory through the shared hf_writer; rank 0 writes."""
        from rlctl.formats.hf_writer import save_hf_model

        stream = ((name, t.cpu()) for name, t in self.iter_full_params())
        try:
            if dist.get_rank() == 0:
                save_hf_model(out_dir, stream, meta_dir=meta_dir, dtype=dtype, force=True)
        finally:
            for _ in stream:  # every rank must take part in every gather
                pass
        dist.barrier()
        return Path(out_dir)


# megatron-core 0.16.1 without Transformer Engine or apex steps with torch's AdamW, whose per-parameter
# state holds the step count; its distributed optimizer cannot load a checkpoint into it as it is:


def _torch_adam_optimizers(optimizer) -> list:
    """The distributed optimizers (of a chained one) that step with torch's Adam/AdamW."""
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt for opt in chained if isinstance(opt.optimizer, torch.optim.Adam | torch.optim.AdamW)]


def _init_torch_adam_state(optimizer) -> None:
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
def _torch_adam_load_fix(optimizer) -> Iterator[None]:
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


def _moved(x: Any, device: torch.device | str) -> Any:
    """Tensors (also inside lists and dicts) moved to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _moved(v, device) for k, v in x.items()}
    if isinstance(x, list):
        return [_moved(v, device) for v in x]
    return x


class _StageGather:
    """``(tp_rank, pp_rank, name) -> tensor`` for :func:`megatron_to_hf`, collective on every rank.

    The first request of a name gathers all its TP parts on its stage (all_gather) and broadcasts them
    to the other stages of the pipeline; later TP ranks of the same name come from that result.
    """

    def __init__(self, local: dict[str, torch.Tensor], tp: int, pp: int, device: torch.device, dtype: torch.dtype):
        from megatron.core import parallel_state

        self.local, self.tp, self.pp, self.device, self.dtype = local, tp, pp, device, dtype
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.key: tuple[int, str] | None = None
        self.parts: list[torch.Tensor] = []

    def __call__(self, tp_rank: int, pp_rank: int, name: str) -> torch.Tensor:
        if self.key != (pp_rank, name):
            self.key, self.parts = (pp_rank, name), self._gather(pp_rank, name)
        return self.parts[tp_rank]

    def _gather(self, pp_rank: int, name: str) -> list[torch.Tensor]:
        stacked = None
        if self.stage == pp_rank:
            mine = self.local[name].detach().to(self.device).contiguous()
            if self.tp > 1:
                joined = torch.empty((self.tp * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype, device=self.device)
                dist.all_gather_into_tensor(joined, mine, group=self.tp_group)
                stacked = joined.view(self.tp, *mine.shape)
            else:
                stacked = mine[None]
        if self.pp > 1:
            header = torch.zeros(9, dtype=torch.long, device=self.device)
            if stacked is not None:
                header[0] = stacked.ndim
                header[1 : 1 + stacked.ndim] = torch.tensor(stacked.shape)
            src = self.pp_ranks[pp_rank]
            dist.broadcast(header, src=src, group=self.pp_group)
            if stacked is None:
                stacked = torch.empty(
                    tuple(header[1 : 1 + int(header[0])].tolist()), dtype=self.dtype, device=self.device
                )
            dist.broadcast(stacked, src=src, group=self.pp_group)
        return list(stacked.unbind(0))


def build_engine(
    cfg: RunConfig,
    plan,
    *,
    role: str,
    trainable: bool = True,
    total_steps: int = 0,
    lr: float | None = None,
    source: ModelSource | None = None,
    lora: bool | None = None,
) -> MegatronEngine:
    """The Megatron engine for ``plan.backend == "megatron"``; the arguments of :func:`rlctl.engines.build_engine`."""
    return MegatronEngine(
        cfg, plan, role=role, trainable=trainable, total_steps=total_steps, lr=lr, source=source, lora=lora
    )
