"""From an HF config to megatron-core's: ``TransformerConfig``, the layer spec, the optimizer settings.

Pure translation: nothing here touches weights or process groups (see :mod:`.weights`, :mod:`.parallel`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from typing import Any

import torch

from rlctl.engines.megatron.parallel import pipeline_stages
from rlctl.engines.spec import OptimizerSpec
from rlctl.errors import UserError
from rlctl.formats.megatron_layout import MegatronLayoutConfig

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
INSTALL_HINT = "pip install 'rlctl[megatron]' (or: pip install --no-deps megatron-core)"
#: The padded vocabulary is a multiple of this for every tp dividing it (Megatron-LM pads to 128 * tp,
#: which changes with tp and would make checkpoints tp-specific).
VOCAB_MULTIPLE = 1024
#: Names of the local (non-Transformer-Engine) spec -> the layout's (TE) names, for the fused norms.


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


def rope(hf: Mapping[str, Any]) -> tuple[float, float | None]:
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


def check_sliding_window(hf: Mapping[str, Any], max_seq_len: int) -> None:
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
    from megatron.core.transformer.transformer_config import TransformerConfig

    layout = MegatronLayoutConfig.from_hf_config(hf)
    kwargs: dict[str, Any] = {}
    if recompute:
        kwargs.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    stages = pipeline_stages(layout.num_layers, pp)
    if stages[-1] != stages[0]:  # pp does not divide the layers: even stages, then a shorter last one
        kwargs["num_layers_in_last_pipeline_stage"] = stages[-1]
    return TransformerConfig(
        **_architecture(hf, layout),
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
        bf16=dtype == torch.bfloat16,
        # rlctl's contract: per-rank losses are shares of one global loss; gradients are summed.
        calculate_per_token_loss=True,
        variable_seq_lengths=True,  # micro-batches of any length through the pipeline
        moe_token_dispatcher_type="alltoall",  # (no experts here; the default one rejects variable lengths)
        **_fusions(cuda),
        **kwargs,
    )


def _architecture(hf: Mapping[str, Any], layout: MegatronLayoutConfig) -> dict[str, Any]:
    """The ``TransformerConfig`` fields that describe the architecture (a Llama-style decoder)."""
    import torch.nn.functional as F

    return dict(
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
    )


def _fusions(cuda: bool) -> dict[str, Any]:
    """Fused kernels exist on GPU only (Transformer Engine / apex / torch.jit on CUDA)."""
    te = cuda and have_transformer_engine()
    return dict(
        apply_rope_fusion=te,
        masked_softmax_fusion=te,
        bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda,
        persist_layer_norm=te,  # apex/TE's persistent norm kernel; the local spec's torch norm asserts it off
        gradient_accumulation_fusion=False,
    )


def layer_spec(hf: Mapping[str, Any], *, cuda: bool, config=None):
    """Transformer Engine's layer spec on GPU when installed; otherwise megatron-core's local spec with
    :class:`TorchRMSNorm` for every norm, as the block spec (layers and final norm) of ``config``'s stage.

    Without TE (the ``megatron`` extra does not install it) megatron-core's local spec builds its norms
    with ``WrappedTorchNorm``, which asserts ``persist_layer_norm`` and sequence parallel off
    (megatron-core 0.16.1, ``transformer/torch_norm.py``), and its block's final norm is apex's
    ``FusedLayerNorm`` when apex is installed (LayerNorm only). ``config`` None: the layer spec alone."""
    from megatron.core.models.gpt import gpt_layer_specs

    qk_norm = MegatronLayoutConfig.from_hf_config(hf).qk_norm
    if cuda and have_transformer_engine():
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_norm)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm")
    sub = spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = TorchRMSNorm
    attention = sub.self_attention.submodules
    if qk_norm:
        attention.q_layernorm = attention.k_layernorm = TorchRMSNorm
    if config is None:
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=TorchRMSNorm)


class TorchRMSNorm:
    """``torch.nn.RMSNorm`` for the local spec, built like megatron-core's ``WrappedTorchNorm`` without its
    asserts: with sequence parallel, each TP rank normalises 1/tp of the tokens with a replicated weight,
    so the weight is marked ``sequence_parallel`` and megatron-core's ``finalize_model_grads`` sums its
    gradient over the TP group (as apex's ``FusedLayerNorm`` marks its own).

    The weight is in ``config.params_dtype`` like every other parameter. (``WrappedTorchNorm`` leaves it
    in torch's default fp32, which Megatron-LM's ``Float16Module`` casts away and rlctl has no such
    wrapper. megatron-core 0.16.1's distributed optimizer numbers each parameter group's members in grad
    buffer order, one buffer per dtype, but lists their fp32 copies fp32 parameters first
    (``_build_optimizer_group_ranges`` vs ``_build_model_and_main_param_groups``): in a bf16 model with
    fp32 norms, the checkpoint of a QKV bias reads a norm's optimizer state.)"""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_ignored):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def optimizer_settings(t: OptimizerSpec, *, lr: float, dtype: torch.dtype, offload: bool) -> dict[str, Any]:
    """megatron-core ``OptimizerConfig`` fields: AdamW over the distributed optimizer (fp32 master weights
    beside bf16 parameters), clipping by ``grad_clip``. ``offload``: all optimizer states and the
    step on the CPU (``optimizer_cpu_offload`` with fraction 1.0, which needs the precision-aware optimizer)."""
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
