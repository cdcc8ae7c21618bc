"""A fast decode step for Llama-family models (qwen2, qwen3, llama, mistral) in the hf rollout engine.

The generic loop (:mod:`rlctl.rollout.hf`) calls the HF model once per token with a ``DynamicCache``; for
the small batches of a rollout most of that time is not the matrix products but what surrounds them:
the cache grows by ``torch.cat``, grouped-query attention copies the whole cache per head
(``repeat_kv``), masks are rebuilt every step. This module does the same computation with:

* one KV cache preallocated for the whole generation, ``(layers, 2, rows, kv_heads, max_len,
  head_dim)``, written in place;
* attention as two batched matrix products over ``rows * kv_heads`` (the query heads of a KV head
  are the rows of one product), so grouped-query attention reads the cache without copying it, and
  left padding is one additive mask fixed for the whole generation;
* one fused QKV and one fused gate/up projection per layer. The fused weights are the storage of the
  HF modules' own parameters (``q_proj.weight`` is a view into the QKV weight), so weights loaded
  into the model in place (:meth:`HFRolloutEngine.update_weights`) are the fast path's at once;
* on CPU in fp32, the large products by oneDNN from prepacked weights, repacked when a weight's
  version counter says it was written (``FastDecoder.PACK_MIN_NUMEL``);
* RoPE cos/sin from the model's own rotary embedding, once per generation for every position, applied
  to the whole fused QKV output at once (the value heads with cos 1, sin 0);
* rows whose sample finished are computed on (their output ignored) until compacting the batch pays
  (``DecodeState.COMPACT_ROW_STEPS``).

The prefill is this module's too (``DecodeState.prefill``): one row per prompt, causal attention
within each left-padded row by SDPA, keys and values written straight into the ``n`` rows of the
preallocated cache, logits for the last position only (measured on CPU: 1.1 ms instead of 2.1 ms for
the HF forward and cache copy with 2 prompts of 27 tokens, hidden 128; 9 ms instead of 13 ms with
prompts of 320 tokens; 352 ms instead of 453 ms at hidden 512 x 8 layers).
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

MODEL_TYPES = ("qwen2", "qwen3", "llama", "mistral", "qwen2_vl_text", "qwen2_5_vl_text")  # (VL: the text model)
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
    head_dim = inner.layers[0].self_attn.head_dim
    with torch.no_grad():
        probe = inner.embed_tokens.weight[:1]
        cos, _ = rope_table(rotary, probe, torch.zeros(1, dtype=torch.long, device=probe.device))
    if cos.shape[-1] != head_dim:
        return f"rotary dimension {cos.shape[-1]} != head_dim {head_dim} (partial rotary)"
    return None


def rope_table(rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the 1-D ``positions`` from a model's own rotary embedding, each (len(positions), head_dim),
    in ``x``'s dtype. A multimodal rope (Qwen2-VL's: ``mrope_section``) takes one row of position ids per axis,
    (3, batch, len); a text token sits at the same position on all three. transformers 5.17's
    Qwen2VLRotaryEmbedding indexes exactly that shape (2-D ids raise IndexError: seen on the first GPU run),
    later versions also broadcast 2-D ids, so the three axes are always passed."""
    ids = positions[None]
    if getattr(rotary, "mrope_section", None) is not None:
        ids = ids[None].expand(3, 1, -1)
    cos, sin = rotary(x, ids)
    return cos[0], sin[0]


class TextModel:
    """A vision-language model's text part as the fast decode step reads a CausalLM: ``config`` (the text config),
    ``model`` (its decoder: layers, embeddings, final norm, rotary embedding) and ``lm_head``. Qwen2-VL's
    multimodal rope is plain rope for text tokens (the three axes at the same position), which is all the
    decode steps feed; the prompt (and its images) is prefilled by the whole model (rlctl.rollout.hf)."""

    def __init__(self, model: nn.Module) -> None:
        self.config = model.config.get_text_config()
        self.model = model.model.language_model
        self.lm_head = model.lm_head


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
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    q_norm: torch.Tensor | None  # (heads, head_dim): q_norm's weight per query head, k_norm's per KV head
    k_norm: torch.Tensor | None
    qk_eps: float


class FastDecoder:
    """The decode step of one model; build it once per engine (it fuses the model's projections)."""

    # On CPU in fp32, weight matrices of at least this many elements are multiplied by oneDNN from a
    # prepacked copy (repacked when the weights change): measured on a Qwen2 of hidden 512 with 16 rows
    # a step's products take 9.5 ms instead of 17 ms with MKL. Small matrices are as fast or faster
    # with MKL (hidden 128, 8 rows: 32 us vs 30 us for the gate/up product).
    PACK_MIN_NUMEL = 1 << 17

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
                    qkv=_Linear(qkv_w, qkv_b),
                    o=_Linear(attn.o_proj.weight, attn.o_proj.bias),
                    gate_up=_Linear(gu_w, gu_b),
                    down=_Linear(mlp.down_proj.weight, mlp.down_proj.bias),
                    q_norm=qk_norm.weight if qk_norm is not None else None,
                    k_norm=attn.k_norm.weight if qk_norm is not None else None,
                    qk_eps=qk_norm.variance_epsilon if qk_norm is not None else 0.0,
                )
            )
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.norm_eps = inner.norm.variance_epsilon
        self.lm_head = _Linear(model.lm_head.weight, None)
        self.intermediate = self.layers[0].down.weight.shape[1]
        self.linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        self.linears.append(self.lm_head)

    def window_reason(self, total_len: int) -> str | None:
        if self.window is not None and self.window < total_len:
            return f"sliding window {self.window} < sequence length {total_len}"
        return None

    def start(self, prompt_lens: list[int], n: int, max_new: int, *, keep_rows: bool = False) -> DecodeState:
        """The decode state of a generation of left-padded prompts, ``n`` samples each; ``prefill`` next.
        ``keep_rows``: never compact, so every row's keys and values can be read at the end (:meth:`DecodeState.
        row_kv`), and start from zeros (a prefill after cached columns leaves no column unwritten garbage)."""
        weight = self.lm_head.weight
        pack = weight.device.type == "cpu" and weight.dtype == torch.float32 and _mkldnn_linear_available()
        for linear in self.linears:
            linear.refresh(pack and linear.weight.numel() >= self.PACK_MIN_NUMEL)
        # each RMSNorm weight twice over, for rms_norm's fp32 path (taken per generation: weights change)
        self.ln_pairs = [(_pair(layer.ln1), _pair(layer.ln2)) for layer in self.layers]
        self.norm_pair = _pair(self.norm)
        return DecodeState(self, prompt_lens, n, max_new, keep_rows=keep_rows)


class DecodeState:
    """The preallocated caches and per-row state of one generation; ``step`` decodes one token."""

    # Finished rows are still computed (their output ignored) until (finished rows) x (steps left)
    # reaches this; then the batch is compacted (one index_select of the caches). Measured on CPU with
    # rows finishing all along (2 prompts x 8 samples x 64 tokens, Qwen2 hidden 512 x 8 layers):
    # 655 ms compacting at once or at 4, 914 ms never; on hidden 128 x 2 layers all within noise.
    COMPACT_ROW_STEPS = 4

    def __init__(self, dec: FastDecoder, prompt_lens: list[int], n: int, max_new: int, *, keep_rows: bool = False):
        self.dec = dec
        first = dec.layers[0].qkv.weight
        device, dtype = first.device, first.dtype
        prompts, width = len(prompt_lens), max(prompt_lens)
        rows, kv, hd, layers = prompts * n, dec.kv_heads, dec.head_dim, len(dec.layers)
        self.max_len = width + max_new
        self.t = width  # next cache column
        # every layer's keys and values: (layers, 2, rows, kv_heads, max_len, head_dim)
        alloc = torch.zeros if keep_rows else torch.empty
        buf = alloc(layers, 2, prompts, n, kv, self.max_len, hd, device=device, dtype=dtype)
        self.keep_rows = keep_rows
        self.prompt_kv = buf[..., :width, :]  # the prompts' columns, one row per prompt (x n, broadcast)
        self.kv = buf.view(layers, 2, rows, kv, self.max_len, hd)
        # additive mask: -inf on each row's left padding, per (row, kv head) to match the products' batch
        lens = torch.tensor(prompt_lens, device=device).repeat_interleave(n)
        cols = torch.arange(self.max_len, device=device)
        pad = cols[None, :] < (width - lens)[:, None]
        bias = torch.zeros(rows, self.max_len, device=device, dtype=dtype).masked_fill(pad, float("-inf"))
        self.bias = bias[:, None, None, :].expand(rows, kv, 1, self.max_len).contiguous()
        self.position = lens.clone()  # next position id of each row (each prompt starts at 0)
        cos, sin = rope_table(dec.model.model.rotary_emb, self.bias, torch.arange(self.max_len, device=device))
        half = hd // 2
        sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # rotate_half's sign folded in
        self.rope = torch.stack([cos, sin], dim=0)  # (2, positions, head_dim)
        self.qk_norm = [
            torch.cat([layer.q_norm.expand(dec.heads, hd), layer.k_norm.expand(kv, hd)])
            for layer in dec.layers
            if layer.q_norm is not None
        ]
        self.rows = rows
        self.active = torch.arange(rows, device=device)  # physical rows still decoding
        self.num_active = rows
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self._rope_buffer()  # and the fixed views

    def prefill(self, input_ids: torch.Tensor, cached: int = 0) -> torch.Tensor:
        """Prefill the left-padded prompts ``input_ids`` (prompts, width) into the cache (each prompt's
        keys and values into its ``n`` rows); return the logits at each prompt's last position.

        The HF model's computation: each token attends causally within its prompt, padding masked (a pad
        attends to itself only, so it stays finite), position ids from 0 at each prompt's first token.
        ``cached``: the keys and values of the columns before it are in the cache already (:meth:`load_row_kv`,
        ``n`` = 1): only the columns from ``cached`` on are computed (a multi-turn continuation)."""
        dec = self.dec
        prompts, width = input_ids.shape
        q_len = width - cached
        heads, kv, hd = dec.heads, dec.kv_heads, dec.head_dim
        qk_heads, half, inter = heads + kv, hd // 2, dec.intermediate
        start = width - self.position.view(prompts, -1)[:, 0]  # first real column of each prompt
        cols = torch.arange(width, device=input_ids.device)
        q_cols = cols[cached:]
        positions = (q_cols[None, :] - start[:, None]).clamp(min=0)
        cos, sin = self.rope[:, positions, None].unbind(0)  # (prompts, q_len, 1, head_dim)
        sin_lo, sin_hi = sin[..., :half], sin[..., half:]
        causal = cols[None, :] <= q_cols[:, None]
        diagonal = cols[None, :] == q_cols[:, None]
        mask = ((causal & (cols[None, None, :] >= start[:, None, None])) | diagonal)[:, None]  # query x key
        qk_norms = self.qk_norm or [None] * len(dec.layers)
        h = F.embedding(input_ids[:, cached:], dec.embed).view(prompts * q_len, -1)
        for i, (layer, (ln1, ln2), qk_norm) in enumerate(zip(dec.layers, dec.ln_pairs, qk_norms, strict=True)):
            qkv = layer.qkv(rms_norm(h, layer.ln1, layer.eps1, ln1)).view(prompts, q_len, qk_heads + kv, hd)
            qk = qkv[:, :, :qk_heads]
            if qk_norm is not None:
                qk = rms_norm(qk, qk_norm, layer.qk_eps)
            r = qk * cos
            r[..., :half].addcmul_(qk[..., half:], sin_lo)
            r[..., half:].addcmul_(qk[..., :half], sin_hi)
            k, v = r[:, :, heads:].transpose(1, 2), qkv[:, :, qk_heads:].transpose(1, 2)
            self.prompt_kv[i, 0, ..., cached:, :].copy_(k[:, None])
            self.prompt_kv[i, 1, ..., cached:, :].copy_(v[:, None])
            if cached:  # the keys and values of every column, the cached ones included (n = 1)
                k, v = self.prompt_kv[i, 0, :, 0], self.prompt_kv[i, 1, :, 0]
            q = r[:, :, :heads].transpose(1, 2)  # (prompts, heads, width, head_dim)
            if i == len(dec.layers) - 1:  # the last layer: only the last position goes on
                q, mask, h = q[:, :, -1:], mask[:, :, -1:], h.view(prompts, q_len, -1)[:, -1]
            if heads != kv:  # masked: repeat the KV heads (enable_gqa with a mask is the math kernel on CUDA)
                k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, mask, scale=dec.scaling)
            h = layer.o.add_to(h, out.transpose(1, 2).reshape(len(h), heads * hd))
            gu = layer.gate_up(rms_norm(h, layer.ln2, layer.eps2, ln2))
            h = layer.down.add_to(h, F.silu(gu[:, :inter]) * gu[:, inter:])
        return dec.lm_head(rms_norm(h, dec.norm, dec.norm_eps, dec.norm_pair))

    def load_row_kv(self, prompt: int, column: int, kv: torch.Tensor) -> None:
        """Put kept keys and values ``kv`` (layers, 2, kv_heads, L, head_dim) at ``column`` of prompt ``prompt``'s
        row (n = 1), before a :meth:`prefill` with ``cached`` past them."""
        self.prompt_kv[:, :, prompt, 0, :, column : column + kv.shape[3]].copy_(kv)

    def row_kv(self, row: int, start: int, stop: int) -> torch.Tensor:
        """A copy of row ``row``'s keys and values of columns [start, stop) (``keep_rows`` states)."""
        return self.kv[:, :, row, :, start:stop].clone()

    def _rope_buffer(self) -> None:
        # cos and sin for every head of the fused QKV output; the value heads get cos 1, sin 0 (unrotated)
        dec = self.dec
        cs = self.rope.new_zeros(2, self.rows, dec.heads + 2 * dec.kv_heads, dec.head_dim)
        cs[0, :, dec.heads + dec.kv_heads :] = 1
        self.cs = cs
        cos, sin = cs.unbind(0)
        half = dec.head_dim // 2
        self.cos, self.sin_lo, self.sin_hi = cos, sin[..., :half], sin[..., half:]
        # views fixed until the next compaction (each step slices the columns written so far): per layer
        # the cache (2, rows, kv, max_len, head_dim), the keys (transposed) and values read,
        # (rows * kv, head_dim, max_len) and (rows * kv, max_len, head_dim)
        rows, kv, max_len = self.rows, dec.kv_heads, self.max_len
        self.layer_kv = self.kv.unbind(0)
        context = self.kv.view(-1, 2, rows * kv, max_len, dec.head_dim)
        self.keys_t, self.values = context[:, 0].transpose(2, 3).unbind(0), context[:, 1].unbind(0)
        self.bias_flat = self.bias.view(rows * kv, 1, max_len)

    def drop(self, keep: torch.Tensor) -> None:
        """Keep only the active rows at indices ``keep`` (into the current active rows)."""
        self.active = self.active[keep]
        self.num_active = len(keep)
        if not self.keep_rows and (self.rows - self.num_active) * (self.max_len - self.t) >= self.COMPACT_ROW_STEPS:
            idx = self.active
            self.kv = self.kv.index_select(2, idx)
            self.bias = self.bias.index_select(0, idx)
            self.position = self.position.index_select(0, idx)
            self.tokens = self.tokens.index_select(0, idx)
            self.rows = self.num_active
            self.active = torch.arange(self.rows, device=idx.device)
            self._rope_buffer()  # and the fixed views

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per active row; return the next-token logits of the active rows."""
        dec = self.dec
        if self.num_active == self.rows:
            self.tokens = tokens
        else:
            self.tokens.index_copy_(0, self.active, tokens)
        rows, t = self.rows, self.t
        heads, kv, hd = dec.heads, dec.kv_heads, dec.head_dim
        qk_heads, group, half, inter = heads + kv, heads // kv, hd // 2, dec.intermediate
        self.cs[:, :, :qk_heads] = self.rope.index_select(1, self.position)[:, :, None]
        cos, sin_lo, sin_hi = self.cos, self.sin_lo, self.sin_hi
        # the columns written so far, this step's included (it is written below, before it is read): the
        # masked columns not yet written would add ~2% to the flops of the compute regime (hidden 512)
        bias, seen = self.bias_flat[:, :, : t + 1], t + 1
        qk_norms = self.qk_norm or [None] * len(dec.layers)
        fp32 = self.kv.dtype == torch.float32
        kv_shape, q_shape, attn_shape = (rows, 2, kv, hd), (rows * kv, group, hd), (rows, heads * hd)
        h = F.embedding(self.tokens, dec.embed)
        layers = zip(dec.layers, dec.ln_pairs, self.layer_kv, self.keys_t, self.values, qk_norms, strict=True)
        for layer, (ln1, ln2), layer_kv, k_t, v, qk_norm in layers:
            x = rms_norm(h, layer.ln1, layer.eps1, ln1)
            qkv = layer.qkv(x).view(rows, qk_heads + kv, hd)
            if qk_norm is not None:
                qkv = torch.cat([rms_norm(qkv[:, :qk_heads], qk_norm, layer.qk_eps), qkv[:, qk_heads:]], dim=1)
            # x * cos + rotate_half(x) * sin, rotate_half's sign folded into sin (value heads: cos 1, sin 0)
            r = qkv * cos
            r[..., :half].addcmul_(qkv[..., half:], sin_lo)
            r[..., half:].addcmul_(qkv[..., :half], sin_hi)
            layer_kv.select(3, t).copy_(r[:, heads:].view(kv_shape).transpose(0, 1))
            scores = torch.baddbmm(bias, r[:, :heads].reshape(q_shape), k_t[:, :, :seen], alpha=dec.scaling)
            probs = scores.softmax(-1) if fp32 else scores.softmax(-1, dtype=torch.float32).to(scores.dtype)
            h = layer.o.add_to(h, torch.bmm(probs, v[:, :seen]).view(attn_shape))
            gu = layer.gate_up(rms_norm(h, layer.ln2, layer.eps2, ln2))
            h = layer.down.add_to(h, F.silu(gu[:, :inter]) * gu[:, inter:])
        logits = dec.lm_head(rms_norm(h, dec.norm, dec.norm_eps, dec.norm_pair))
        self.t += 1
        self.position += 1
        if self.num_active != self.rows:
            logits = logits.index_select(0, self.active)
        return logits


def _pair(weight: torch.Tensor) -> torch.Tensor | None:
    return torch.cat([weight, weight]) if weight.dtype == torch.float32 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pair: torch.Tensor | None = None) -> torch.Tensor:
    """HF's RMSNorm: normalized in fp32, cast back to the input's dtype, times the weight.

    With ``pair`` (the weight twice over) and ``x`` 2-D fp32: the LayerNorm of ``[x, -x]`` (mean 0,
    variance mean(x^2)), its first half. One fused kernel: on CPU, 8 x 128, 8.5 us instead of 11.7 us
    for ``F.rms_norm`` (which is ~10 small ops there), equal to it up to float rounding (~1e-7)."""
    if pair is not None and x.dim() == 2 and x.dtype == torch.float32:
        d = x.shape[-1]
        return F.layer_norm(torch.cat([x, x.neg()], dim=-1), pair.shape, pair, None, eps)[:, :d]
    if x.dtype == torch.float32:
        if weight.dim() == 1:
            return F.rms_norm(x, x.shape[-1:], weight, eps)
        return weight * F.rms_norm(x, x.shape[-1:], None, eps)  # one weight per head (qk-norm)
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def _mkldnn_linear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class _Linear:
    """``x @ weight.T + bias``, by oneDNN from a prepacked copy of the weight when ``refresh`` packed it."""

    __slots__ = ("weight", "weight_t", "bias", "packed", "version")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.weight_t = weight.t()  # a view: in-place writes to the weight are seen; one t() less per call
        self.packed: torch.Tensor | None = None
        self.version = -1

    def refresh(self, pack: bool) -> None:
        """Pack (again, when the weight was written in place since) or drop the packed copy."""
        if not pack:
            self.packed = None
        elif self.packed is None or self.version != self.weight._version:
            self.version = self.weight._version
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            if x.dim() != 2:
                return F.linear(x, self.weight, self.bias)
            return torch.mm(x, self.weight_t) if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x)."""
        if self.packed is not None:
            return residual + self(x)
        out = torch.addmm(residual, x, self.weight_t)
        return out if self.bias is None else out + self.bias
