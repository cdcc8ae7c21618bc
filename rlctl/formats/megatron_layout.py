"""HF <-> Megatron-core ``GPTModel`` weight layout: a pure tensor mapping, no files.

One Megatron rank ``(tp_rank, pp_rank)`` holds, with layers numbered locally from 0 on every
pipeline stage (global layer = stage * layers_per_stage + local):

===============================================================  ==================================
Megatron name (per rank)                                          HF source, how it is split
===============================================================  ==================================
``embedding.word_embeddings.weight`` (first stage)                ``model.embed_tokens.weight``, vocab
                                                                  padded then split by rows
``decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight`` ``input_layernorm.weight``, copied
``decoder.layers.{i}.self_attention.linear_qkv.weight`` / ``.bias`` ``q/k/v_proj``, fused per query group,
                                                                  split by groups
``decoder.layers.{i}.self_attention.q_layernorm.weight`` (Qwen3)  ``self_attn.q_norm.weight``, copied
``decoder.layers.{i}.self_attention.k_layernorm.weight`` (Qwen3)  ``self_attn.k_norm.weight``, copied
``decoder.layers.{i}.self_attention.linear_proj.weight``          ``o_proj``, split on dim 1
``decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight``           ``post_attention_layernorm``, copied
``decoder.layers.{i}.mlp.linear_fc1.weight``                      ``[gate slice; up slice]`` of the rank
``decoder.layers.{i}.mlp.linear_fc2.weight``                      ``down_proj``, split on dim 1
``decoder.final_layernorm.weight`` (last stage)                   ``model.norm.weight``
``output_layer.weight`` (last stage)                              ``lm_head.weight`` (padded, split by
                                                                  rows); for tied embeddings only when
                                                                  pp > 1 (a copy of the embedding)
===============================================================  ==================================

The fused QKV weight holds, for each of the ``num_kv_heads`` query groups, the group's
``q_per_group * head_dim`` rows of Q, then ``head_dim`` rows of K, then ``head_dim`` rows of V; TP rank
``r`` holds groups ``[r * kv/tp, (r + 1) * kv/tp)``. The vocabulary is padded to a multiple of
``make_vocab_size_divisible_by * tp`` with zero rows, stripped again on the way back. The norm names are
those of the Transformer-Engine layer spec (norms fused into the linear layers); the local (non-TE)
spec names them ``input_layernorm.weight`` / ``pre_mlp_layernorm.weight`` in its module state dict.

A tensor source is a function ``name -> tensor`` whose result can be sliced with ``[a:b]`` and
``[:, a:b]``: a ``torch.Tensor`` or a lazy safetensors slice (``safe_open(...).get_slice(name)``), so a
rank reads only the rows it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from rlctl.catalog.parallel import tp_problem, valid_pps, valid_tps
from rlctl.errors import UserError, did_you_mean

#: HF ``model_type`` -> whether q/k/v always carry a bias (Qwen2) and whether q/k norms exist (Qwen3).
_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "qwen2": (True, False),
    "qwen3": (False, True),
    "llama": (False, False),
    "mistral": (False, False),
}
_ARCHITECTURE_CLASSES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
}

#: ``name -> tensor or lazy slice`` of an HF checkpoint (e.g. :class:`rlctl.formats.safetensors.HFSafetensors`)
SliceGetter = Callable[[str], Any]
ShardSource = Callable[[int, int, str], Any]


@dataclass(frozen=True)
class MegatronLayoutConfig:
    """The shapes the weight layout depends on, read from an HF ``config.json``."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    make_vocab_size_divisible_by: int = 128

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> MegatronLayoutConfig:
        """Build from an HF config dict (Qwen2/Qwen2.5/Qwen3/Llama/Mistral); UserError otherwise."""
        archs = hf.get("architectures") or []
        model_type = _ARCHITECTURE_CLASSES.get(archs[0]) if archs else None
        model_type = model_type or hf.get("model_type", "")
        if model_type not in _ARCHITECTURES:
            name = archs[0] if archs else model_type or "(no architectures/model_type)"
            raise UserError(
                f"architecture {name!r} has no Megatron layout in rlctl; supported: "
                f"{', '.join(_ARCHITECTURE_CLASSES)}{did_you_mean(str(name), _ARCHITECTURE_CLASSES)}"
            )
        always_bias, qk_norm = _ARCHITECTURES[model_type]
        if hf.get("attention_bias") and not always_bias:
            raise UserError(
                f"{model_type} with attention_bias=true puts a bias on o_proj, which the Megatron layout "
                "has no place for; only configs with attention_bias=false are supported"
            )
        if hf.get("mlp_bias"):
            raise UserError("mlp_bias=true is not supported by the Megatron layout; use mlp_bias=false")
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return cls(
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=always_bias,
            qk_norm=qk_norm,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def padded_vocab_size(cfg: MegatronLayoutConfig, tp: int) -> int:
    """Megatron's vocabulary size: ``vocab_size`` rounded up to ``make_vocab_size_divisible_by * tp``."""
    multiple = cfg.make_vocab_size_divisible_by * tp
    return -(-cfg.vocab_size // multiple) * multiple


def check_parallelism(cfg: MegatronLayoutConfig, tp: int, pp: int) -> None:
    """UserError unless ``tp`` divides the (kv) heads and the FFN and ``pp`` divides the layers."""
    if tp < 1 or pp < 1:
        raise UserError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
    problem = tp_problem(tp, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden_size)
    if problem:
        valid = valid_tps(cfg.num_kv_heads, cfg.num_heads, cfg.num_kv_heads, cfg.ffn_hidden_size)
        raise UserError(
            f"tp={tp}: {problem} of the model (replicating kv heads is not supported); "
            f"valid tp: {', '.join(map(str, valid))}"
        )
    if cfg.num_layers % pp:  # rlctl's shard files hold even stages
        valid = valid_pps(cfg.num_layers, even=True)
        raise UserError(
            f"pp={pp} does not divide the model's {cfg.num_layers} layers; valid pp: {', '.join(map(str, valid))}"
        )


def _hf_layer(g: int) -> str:
    return f"model.layers.{g}."


def _copy(t: Any) -> torch.Tensor:
    """Materialise a (lazy) slice as a fresh contiguous tensor that shares no storage."""
    return t[:].clone(memory_format=torch.contiguous_format)


def _vocab_rows(get: SliceGetter, name: str, cfg: MegatronLayoutConfig, tp: int, tp_rank: int) -> torch.Tensor:
    """The rank's rows of the padded vocabulary; padding rows are zero."""
    per_rank = padded_vocab_size(cfg, tp) // tp
    start = tp_rank * per_rank
    rows = get(name)[start : max(start, min(start + per_rank, cfg.vocab_size))]  # empty when all padding
    pad = torch.zeros(per_rank - rows.shape[0], rows.shape[1], dtype=rows.dtype)
    return torch.cat([rows, pad])


def _fused_qkv(
    get: SliceGetter, prefix: str, suffix: str, cfg: MegatronLayoutConfig, tp: int, tp_rank: int
) -> torch.Tensor:
    """The rank's groups of [Q rows of the group; K rows; V rows] (``suffix`` is weight or bias)."""
    d = cfg.head_dim
    q_per_group = cfg.num_heads // cfg.num_kv_heads
    groups = cfg.num_kv_heads // tp
    first = tp_rank * groups
    q = get(f"{prefix}q_proj.{suffix}")[first * q_per_group * d : (first + groups) * q_per_group * d]
    k = get(f"{prefix}k_proj.{suffix}")[first * d : (first + groups) * d]
    v = get(f"{prefix}v_proj.{suffix}")[first * d : (first + groups) * d]
    rest = q.shape[1:]
    parts = [q.reshape(groups, q_per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def megatron_shard_for_rank(
    get_hf_tensor: SliceGetter, cfg: MegatronLayoutConfig, tp: int, pp: int, tp_rank: int, pp_rank: int
) -> dict[str, torch.Tensor]:
    """The Megatron state dict of rank ``(tp_rank, pp_rank)``, reading only the slices it holds."""
    check_parallelism(cfg, tp, pp)
    get = get_hf_tensor
    per_stage = cfg.num_layers // pp
    ffn = cfg.ffn_hidden_size // tp
    attn_cols = cfg.num_heads * cfg.head_dim // tp
    out: dict[str, torch.Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _vocab_rows(get, "model.embed_tokens.weight", cfg, tp, tp_rank)
    for local in range(per_stage):
        hf = _hf_layer(pp_rank * per_stage + local)
        mg = f"decoder.layers.{local}."
        out[mg + "self_attention.linear_qkv.layer_norm_weight"] = _copy(get(hf + "input_layernorm.weight"))
        out[mg + "self_attention.linear_qkv.weight"] = _fused_qkv(get, hf + "self_attn.", "weight", cfg, tp, tp_rank)
        if cfg.qkv_bias:
            out[mg + "self_attention.linear_qkv.bias"] = _fused_qkv(get, hf + "self_attn.", "bias", cfg, tp, tp_rank)
        if cfg.qk_norm:
            out[mg + "self_attention.q_layernorm.weight"] = _copy(get(hf + "self_attn.q_norm.weight"))
            out[mg + "self_attention.k_layernorm.weight"] = _copy(get(hf + "self_attn.k_norm.weight"))
        cols = slice(tp_rank * attn_cols, (tp_rank + 1) * attn_cols)
        out[mg + "self_attention.linear_proj.weight"] = _copy(get(hf + "self_attn.o_proj.weight")[:, cols])
        out[mg + "mlp.linear_fc1.layer_norm_weight"] = _copy(get(hf + "post_attention_layernorm.weight"))
        rows = slice(tp_rank * ffn, (tp_rank + 1) * ffn)
        gate, up = get(hf + "mlp.gate_proj.weight")[rows], get(hf + "mlp.up_proj.weight")[rows]
        out[mg + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[mg + "mlp.linear_fc2.weight"] = _copy(get(hf + "mlp.down_proj.weight")[:, rows])
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = _copy(get("model.norm.weight"))
        if not cfg.tied_embeddings:
            out["output_layer.weight"] = _vocab_rows(get, "lm_head.weight", cfg, tp, tp_rank)
        elif pp > 1:  # the last stage keeps its own copy of the tied embedding
            out["output_layer.weight"] = _vocab_rows(get, "model.embed_tokens.weight", cfg, tp, tp_rank)
    return out


def hf_to_megatron_shards(
    hf_state: Mapping[str, torch.Tensor], cfg: MegatronLayoutConfig, tp: int, pp: int
) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """All ranks' state dicts at once, keyed ``(tp_rank, pp_rank)`` (for in-memory state dicts)."""
    check_parallelism(cfg, tp, pp)
    return {
        (t, p): megatron_shard_for_rank(hf_state.__getitem__, cfg, tp, pp, t, p) for p in range(pp) for t in range(tp)
    }


def _expect(t: torch.Tensor, shape: tuple[int, ...], where: str) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise UserError(
            f"Megatron tensor {where} has shape {tuple(t.shape)}, expected {shape} from the HF config "
            "and tp/pp; is this the checkpoint's config?"
        )
    return t


def megatron_to_hf(
    get_shard_tensor: ShardSource, cfg: MegatronLayoutConfig, tp: int, pp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream HF ``(name, tensor)`` pairs, layer by layer, from ``get_shard_tensor(tp_rank, pp_rank, name)``.

    Padded vocabulary rows are dropped (any padded size >= ``cfg.vocab_size`` is accepted, so a
    checkpoint padded for another tp reads fine). Tied models yield no ``lm_head.weight``. Bad
    tp/pp raise here; missing or misshapen tensors raise while iterating.
    """
    check_parallelism(cfg, tp, pp)
    return _megatron_to_hf(get_shard_tensor, cfg, tp, pp)


def _megatron_to_hf(
    get_shard_tensor: ShardSource, cfg: MegatronLayoutConfig, tp: int, pp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    shards = _Shards(get_shard_tensor, cfg, tp)
    yield "model.embed_tokens.weight", shards.vocab(0, "embedding.word_embeddings.weight")
    per_stage = cfg.num_layers // pp
    for g_layer in range(cfg.num_layers):
        stage, local = divmod(g_layer, per_stage)
        yield from _layer_to_hf(shards, stage, f"decoder.layers.{local}.", _hf_layer(g_layer))
    yield "model.norm.weight", shards.one(pp - 1, "decoder.final_layernorm.weight", (cfg.hidden_size,))
    if not cfg.tied_embeddings:
        yield "lm_head.weight", shards.vocab(pp - 1, "output_layer.weight")


def _layer_to_hf(shards: _Shards, stage: int, mg: str, hf: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One decoder layer's HF tensors, from its Megatron tensors (prefix ``mg``) on pipeline stage ``stage``."""
    cfg, tp = shards.cfg, shards.tp
    d, h = cfg.head_dim, cfg.hidden_size
    qkv_rows = cfg.num_kv_heads // tp * (cfg.num_heads // cfg.num_kv_heads + 2) * d
    ffn = cfg.ffn_hidden_size // tp
    yield hf + "input_layernorm.weight", shards.one(stage, mg + "self_attention.linear_qkv.layer_norm_weight", (h,))
    q, k, v = shards.split_qkv(shards.gather(stage, mg + "self_attention.linear_qkv.weight", 0, (qkv_rows, h)))
    yield from ((hf + f"self_attn.{n}_proj.weight", x) for n, x in zip("qkv", (q, k, v)))
    if cfg.qkv_bias:
        q, k, v = shards.split_qkv(shards.gather(stage, mg + "self_attention.linear_qkv.bias", 0, (qkv_rows,)))
        yield from ((hf + f"self_attn.{n}_proj.bias", x) for n, x in zip("qkv", (q, k, v)))
    if cfg.qk_norm:
        yield hf + "self_attn.q_norm.weight", shards.one(stage, mg + "self_attention.q_layernorm.weight", (d,))
        yield hf + "self_attn.k_norm.weight", shards.one(stage, mg + "self_attention.k_layernorm.weight", (d,))
    yield (
        hf + "self_attn.o_proj.weight",
        shards.gather(stage, mg + "self_attention.linear_proj.weight", 1, (h, cfg.num_heads * d // tp)),
    )
    yield hf + "post_attention_layernorm.weight", shards.one(stage, mg + "mlp.linear_fc1.layer_norm_weight", (h,))
    fc1 = shards.parts(stage, mg + "mlp.linear_fc1.weight", (2 * ffn, h))
    yield hf + "mlp.gate_proj.weight", torch.cat([x[:ffn] for x in fc1])
    yield hf + "mlp.up_proj.weight", torch.cat([x[ffn:] for x in fc1])
    yield hf + "mlp.down_proj.weight", shards.gather(stage, mg + "mlp.linear_fc2.weight", 1, (h, ffn))


class _Shards:
    """A Megatron checkpoint's tensors by name and pipeline stage: tp shards joined, every shape checked."""

    def __init__(self, get_shard_tensor: ShardSource, cfg: MegatronLayoutConfig, tp: int) -> None:
        self.get, self.cfg, self.tp = get_shard_tensor, cfg, tp

    def parts(self, pp_rank: int, name: str, shape: tuple[int, ...]) -> list[torch.Tensor]:
        """Each tp rank's shard of ``name``, each of ``shape``."""
        return [_expect(self.get(t, pp_rank, name)[:], shape, f"{name} (tp {t}, pp {pp_rank})") for t in range(self.tp)]

    def gather(self, pp_rank: int, name: str, dim: int, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.cat(self.parts(pp_rank, name, shape), dim=dim)

    def vocab(self, pp_rank: int, name: str) -> torch.Tensor:
        """An embedding or output layer, joined over tp and its padding rows dropped."""
        cfg, h = self.cfg, self.cfg.hidden_size
        full = torch.cat([self.get(t, pp_rank, name)[:] for t in range(self.tp)])
        if full.shape[0] < cfg.vocab_size or full.shape[1:] != (h,):
            raise UserError(
                f"Megatron tensor {name} has shape {tuple(full.shape)} after joining tp, expected at "
                f"least ({cfg.vocab_size}, {h}); is this the checkpoint's config?"
            )
        return full[: cfg.vocab_size].clone()

    def one(self, pp_rank: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor every tp rank holds whole (a norm): tp rank 0's."""
        return _expect(self.get(0, pp_rank, name)[:], shape, f"{name} (pp {pp_rank})")

    def split_qkv(self, fused: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Megatron's fused QKV (grouped by kv head: its queries, then k, then v) as HF's q, k and v."""
        cfg = self.cfg
        q_per_group, d, rest = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, fused.shape[1:]
        g = fused.reshape(cfg.num_kv_heads, (q_per_group + 2) * d, *rest)
        q, k, v = g.split([q_per_group * d, d, d], dim=1)
        return tuple(x.reshape(-1, *rest).clone() for x in (q, k, v))
