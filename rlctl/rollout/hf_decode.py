"""A fast decode step for Llama-family models (qwen2, qwen3, llama, mistral) in the hf rollout engine.

The generic loop (:mod:`rlctl.rollout.hf`) calls the HF model once per token with a ``DynamicCache``; for
the small batches of a rollout most of that time is not the matrix products but what surrounds them:
the cache grows by ``torch.cat``, grouped-query attention copies the whole cache per head
(``repeat_kv``), masks are rebuilt every step. This module does the same computation with:

* a preallocated KV cache per layer, ``(2, rows, kv_heads, max_len, head_dim)``, written in place;
* attention as two batched matrix products over ``rows * kv_heads`` (the query heads of a KV head
  are the rows of one product), so grouped-query attention reads the cache without copying it, and
  left padding is one additive mask fixed for the whole generation;
* one fused QKV and one fused gate/up projection per layer. The fused weights are the storage of the
  HF modules' own parameters (``q_proj.weight`` is a view into the QKV weight), so weights loaded
  into the model in place (:meth:`HFRolloutEngine.update_weights`) are the fast path's at once;
* RoPE cos/sin from the model's own rotary embedding, once per generation for every position;
* rows whose sample finished are computed on (their output is ignored) until at least half of the
  batch is finished, then the batch is compacted.

The prefill stays the HF model's forward; its cache is copied once into the preallocated one.
Anything this module does not reproduce exactly (other architectures, a sliding window shorter than
the sequences, rope types that depend on the sequence length, a non-SiLU MLP, quantized or
replaced linear layers) makes :func:`unsupported_reason` return why, and the engine keeps the
generic loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral")
# rope types whose cos/sin depend on the position only (not on the sequence length seen so far)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the fast decode step cannot run ``model`` exactly, or None when it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(MODEL_TYPES)}"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(config, 'hidden_act', None)!r} is not silu"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return f"pretraining_tp={config.pretraining_tp}"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) not in STATIC_ROPE_TYPES:
        return f"rope type {getattr(rotary, 'rope_type', None)!r} is not one of {', '.join(STATIC_ROPE_TYPES)}"
    if type(getattr(inner, "embed_tokens", None)) is not nn.Embedding:
        return "the input embedding is not a plain nn.Embedding"
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or head.bias is not None:
        return "lm_head is not a plain nn.Linear without bias"
    if not _is_rms_norm(getattr(inner, "norm", None)):
        return "the final norm is not an RMSNorm"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not layer_types <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(layer_types)}"
    for layer in inner.layers:
        reason = _layer_reason(layer, qk_norm=model_type == "qwen3")
        if reason:
            return reason
    return None


def sliding_window(model: nn.Module) -> int | None:
    """The attention window of the model's windowed layers (None: every layer attends to everything)."""
    config = model.config
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None)
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return config.sliding_window
    return None


def _is_rms_norm(module: object) -> bool:
    return (
        isinstance(module, nn.Module)
        and type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(getattr(module, "variance_epsilon", None), float)
    )


def _layer_reason(layer: nn.Module, *, qk_norm: bool) -> str | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    names = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    for name in names:
        module = layer.get_submodule(name) if attn is not None and mlp is not None else None
        if type(module) is not nn.Linear:
            return f"{name} is not a plain nn.Linear"
    if getattr(mlp, "act_fn", None).__class__.__name__ not in ("SiLU", "SiLUActivation"):
        return "the MLP activation is not SiLU"
    norms = ["input_layernorm", "post_attention_layernorm"] + (["self_attn.q_norm", "self_attn.k_norm"] * qk_norm)
    for name in norms:
        if not _is_rms_norm(layer.get_submodule(name) if hasattr(layer, name.split(".")[0]) else None):
            return f"{name} is not an RMSNorm"
    if not qk_norm and (hasattr(attn, "q_norm") or hasattr(attn, "k_norm")):
        return "unexpected q/k norms"
    if not isinstance(getattr(attn, "scaling", None), float):
        return "the attention has no float scaling"
    return None


def _fuse(modules: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for ``modules`` stacked on the output dimension; each module's
    parameters become views into it, so writing into the module's parameters writes the fused ones."""
    fused_w = torch.cat([m.weight.detach() for m in modules])
    with_bias = [m.bias is not None for m in modules]
    fused_b = None
    if any(with_bias):
        fused_b = torch.cat(
            [m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules]
        )
    start = 0
    for m in modules:
        stop = start + m.out_features
        m.weight = nn.Parameter(fused_w[start:stop], requires_grad=False)
        if m.bias is not None:
            m.bias = nn.Parameter(fused_b[start:stop], requires_grad=False)
        start = stop
    return fused_w, fused_b


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    eps1: float
    eps2: float
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    gu_w: torch.Tensor
    gu_b: torch.Tensor | None
    down_w: torch.Tensor
    down_b: torch.Tensor | None
    q_norm: torch.Tensor | None  # (heads, head_dim): q_norm's weight per query head, k_norm's per KV head
    k_norm: torch.Tensor | None
    qk_eps: float


class FastDecoder:
    """The decode step of one model; build it once per engine (it fuses the model's projections)."""

    def __init__(self, model: nn.Module) -> None:
        config = model.config
        self.model = model
        inner = model.model
        first = inner.layers[0].self_attn
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.window = sliding_window(model)
        self.layers: list[_Layer] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gu_w, gu_b = _fuse([mlp.gate_proj, mlp.up_proj])
            qk_norm = getattr(attn, "q_norm", None)
            self.layers.append(
                _Layer(
                    ln1=layer.input_layernorm.weight,
                    ln2=layer.post_attention_layernorm.weight,
                    eps1=layer.input_layernorm.variance_epsilon,
                    eps2=layer.post_attention_layernorm.variance_epsilon,
                    qkv_w=qkv_w,
                    qkv_b=qkv_b,
                    o_w=attn.o_proj.weight,
                    o_b=attn.o_proj.bias,
                    gu_w=gu_w,
                    gu_b=gu_b,
                    down_w=mlp.down_proj.weight,
                    down_b=mlp.down_proj.bias,
                    q_norm=qk_norm.weight if qk_norm is not None else None,
                    k_norm=attn.k_norm.weight if qk_norm is not None else None,
                    qk_eps=qk_norm.variance_epsilon if qk_norm is not None else 0.0,
                )
            )
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.norm_eps = inner.norm.variance_epsilon
        self.lm_head = model.lm_head.weight
        self.intermediate = self.layers[0].down_w.shape[1]

    def window_reason(self, total_len: int) -> str | None:
        if self.window is not None and self.window < total_len:
            return f"sliding window {self.window} < sequence length {total_len}"
        return None

    def start(self, cache, prompt_lens: list[int], n: int, max_new: int) -> DecodeState:
        """The decode state after a prefill of left-padded prompts into HF ``cache`` (one row per prompt)."""
        return DecodeState(self, cache, prompt_lens, n, max_new)


class DecodeState:
    """The preallocated caches and per-row state of one generation; ``step`` decodes one token."""

    def __init__(self, dec: FastDecoder, cache, prompt_lens: list[int], n: int, max_new: int) -> None:
        self.dec = dec
        first = dec.layers[0].qkv_w
        device, dtype = first.device, first.dtype
        prompts, width = len(prompt_lens), max(prompt_lens)
        rows, kv, hd = prompts * n, dec.kv_heads, dec.head_dim
        self.max_len = width + max_new
        self.t = width  # next cache column
        self.kv: list[torch.Tensor] = []
        for i in range(len(dec.layers)):
            buf = torch.empty(2, prompts, n, kv, self.max_len, hd, device=device, dtype=dtype)
            layer = cache.layers[i]
            buf[0, :, :, :, :width] = layer.keys[:, None]
            buf[1, :, :, :, :width] = layer.values[:, None]
            self.kv.append(buf.view(2, rows, kv, self.max_len, hd))
        # additive mask: -inf on each row's left padding, per (row, kv head) to match the products' batch
        lens = torch.tensor(prompt_lens, device=device).repeat_interleave(n)
        cols = torch.arange(self.max_len, device=device)
        pad = cols[None, :] < (width - lens)[:, None]
        bias = torch.zeros(rows, self.max_len, device=device, dtype=dtype).masked_fill(pad, float("-inf"))
        self.bias = bias[:, None, None, :].expand(rows, kv, 1, self.max_len).contiguous()
        self.position = lens.clone()  # next position id of each row (each prompt starts at 0)
        positions = torch.arange(int(max(prompt_lens)) + max_new, device=device)
        cos, sin = dec.model.model.rotary_emb(self.bias, positions[None])
        half = hd // 2
        sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # rotate_half's sign folded in
        self.rope = torch.stack([cos[0], sin], dim=1)  # (positions, 2, head_dim)
        self.rows = rows
        self.active = torch.arange(rows, device=device)  # physical rows still decoding
        self.num_active = rows
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)

    def drop(self, keep: torch.Tensor) -> None:
        """Keep only the active rows at indices ``keep`` (into the current active rows)."""
        self.active = self.active[keep]
        self.num_active = len(keep)
        if 2 * self.num_active <= self.rows:
            idx = self.active
            self.kv = [buf.index_select(1, idx) for buf in self.kv]
            self.bias = self.bias.index_select(0, idx)
            self.position = self.position.index_select(0, idx)
            self.tokens = self.tokens.index_select(0, idx)
            self.rows = self.num_active
            self.active = torch.arange(self.rows, device=idx.device)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per active row; return the next-token logits of the active rows."""
        dec = self.dec
        if self.num_active == self.rows:
            self.tokens = tokens
        else:
            self.tokens.index_copy_(0, self.active, tokens)
        rows, t = self.rows, self.t
        heads, kv, hd = dec.heads, dec.kv_heads, dec.head_dim
        group = heads // kv
        rope = self.rope.index_select(0, self.position)  # (rows, 2, head_dim)
        cos, sin = rope[:, :1], rope[:, 1:]
        bias = self.bias.view(rows * kv, 1, self.max_len)[:, :, : t + 1]
        h = F.embedding(self.tokens, dec.embed)
        half = hd // 2
        qk_heads = heads + kv
        for layer, cache in zip(dec.layers, self.kv, strict=True):
            x = rms_norm(h, layer.ln1, layer.eps1)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b).view(rows, qk_heads + kv, hd)
            qk = qkv[:, :qk_heads]
            if layer.q_norm is not None:
                qk = torch.cat(
                    [
                        rms_norm(qk[:, :heads], layer.q_norm, layer.qk_eps),
                        rms_norm(qk[:, heads:], layer.k_norm, layer.qk_eps),
                    ],
                    dim=1,
                )
            qk = qk * cos + torch.cat([qk[..., half:], qk[..., :half]], dim=-1) * sin
            cache[0, :, :, t] = qk[:, heads:]
            cache[1, :, :, t] = qkv[:, qk_heads:]
            q = qk[:, :heads].reshape(rows * kv, group, hd)
            keys = cache[0].view(rows * kv, self.max_len, hd)[:, : t + 1]
            values = cache[1].view(rows * kv, self.max_len, hd)[:, : t + 1]
            scores = torch.baddbmm(bias, q, keys.transpose(1, 2), alpha=dec.scaling)
            if scores.dtype == torch.float32:
                probs = scores.softmax(-1)
            else:
                probs = scores.softmax(-1, dtype=torch.float32).to(scores.dtype)
            attn = torch.bmm(probs, values).view(rows, heads * hd)
            h = _linear_add(h, attn, layer.o_w, layer.o_b)
            x = rms_norm(h, layer.ln2, layer.eps2)
            gu = F.linear(x, layer.gu_w, layer.gu_b)
            act = F.silu(gu[:, : dec.intermediate]) * gu[:, dec.intermediate :]
            h = _linear_add(h, act, layer.down_w, layer.down_b)
        logits = F.linear(rms_norm(h, dec.norm, dec.norm_eps), dec.lm_head)
        self.t += 1
        self.position += 1
        if self.num_active != self.rows:
            logits = logits.index_select(0, self.active)
        return logits


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: the variance in fp32, the weight applied in the input's dtype."""
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    y = x.float()
    return weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _linear_add(
    residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """residual + x @ weight.T (+ bias)."""
    out = torch.addmm(residual, x, weight.t())
    return out if bias is None else out + bias
