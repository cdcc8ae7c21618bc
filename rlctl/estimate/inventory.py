"""Where a model's parameters live: per decoder layer, split the way memory is split.

The estimator needs more than a total: tensor parallelism splits attention and MLP weights,
expert parallelism splits only the routed experts, a pipeline stage holds a run of layers plus the
embedding or the output head, and LoRA attaches adapters to named linear layers. This module
lists every parameter of a catalog :class:`~rlctl.catalog.spec.ModelSpec` the way transformers
builds the model (routed experts fused into ``experts.gate_up_proj``/``down_proj`` tensors, the
router a plain weight); the layers, the embedding, the output head and the final norm add up to
:func:`rlctl.catalog.count_params` (a test checks it for every catalog model).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from rlctl.catalog.count import vision_block_params, vision_merger_params
from rlctl.catalog.spec import ModelSpec, VisionSpec
from rlctl.errors import UserError


@dataclass(frozen=True)
class Linear:
    """One ``nn.Linear`` of a decoder layer (the modules LoRA can target)."""

    name: str  # module name as in transformers, e.g. "q_proj", "shared_experts.gate_proj"
    fan_in: int
    fan_out: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.fan_in * self.fan_out + (self.fan_out if self.bias else 0)


@dataclass(frozen=True)
class LayerParams:
    """The parameters of one decoder layer, grouped by how parallelism splits them."""

    attention: tuple[Linear, ...]
    mlp: tuple[Linear, ...]  # dense MLP, or a MoE layer's shared experts
    experts: int  # routed experts (all of them), 0 for a dense layer
    router: int  # router weight (MoE), replicated
    other: int  # norms (layer norms, q/k norms, MLA's latent norms), replicated

    @property
    def linears(self) -> tuple[Linear, ...]:
        return self.attention + self.mlp

    @property
    def total(self) -> int:
        return sum(lin.params for lin in self.linears) + self.experts + self.router + self.other

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


def _attention(spec: ModelSpec) -> tuple[tuple[Linear, ...], int]:
    h, a = spec.hidden_size, spec.num_heads
    if spec.uses_mla:  # DeepSeek multi-head latent attention
        qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
        lins = []
        norms = spec.kv_lora_rank
        if spec.q_lora_rank:
            lins += [
                Linear("q_a_proj", h, spec.q_lora_rank, spec.qkv_bias),
                Linear("q_b_proj", spec.q_lora_rank, a * qk),
            ]
            norms += spec.q_lora_rank
        else:
            lins.append(Linear("q_proj", h, a * qk))
        lins += [
            Linear("kv_a_proj_with_mqa", h, spec.kv_lora_rank + spec.qk_rope_head_dim, spec.qkv_bias),
            Linear("kv_b_proj", spec.kv_lora_rank, a * (spec.qk_nope_head_dim + spec.v_head_dim)),
            Linear("o_proj", a * spec.v_head_dim, h, spec.o_bias),
        ]
        return tuple(lins), norms
    q, kv = a * spec.head_dim, spec.num_kv_heads * spec.head_dim
    lins = (
        Linear("q_proj", h, q, spec.qkv_bias),
        Linear("k_proj", h, kv, spec.qkv_bias),
        Linear("v_proj", h, kv, spec.qkv_bias),
        Linear("o_proj", q, h, spec.o_bias),
    )
    return lins, (2 * spec.head_dim if spec.qk_norm else 0)


def _gated_mlp(prefix: str, h: int, f: int, bias: bool) -> tuple[Linear, ...]:
    return (
        Linear(f"{prefix}gate_proj", h, f, bias),
        Linear(f"{prefix}up_proj", h, f, bias),
        Linear(f"{prefix}down_proj", f, h, bias),
    )


@lru_cache(maxsize=64)
def _layer(spec: ModelSpec, moe: bool) -> LayerParams:
    h = spec.hidden_size
    attention, attn_norms = _attention(spec)
    norms = (4 if spec.arch == "gemma2" else 2) * h + attn_norms
    if not moe:
        return LayerParams(attention, _gated_mlp("", h, spec.intermediate_size, spec.mlp_bias), 0, 0, norms)
    f = spec.expert_intermediate_size
    bias = spec.mlp_bias
    shared = _gated_mlp("shared_experts.", h, f * spec.shared_experts, bias) if spec.shared_experts else ()
    experts = spec.num_experts * (3 * h * f + ((2 * f + h) if bias else 0))
    return LayerParams(attention, shared, experts, spec.num_experts * h, norms)


def layer_params(spec: ModelSpec, index: int) -> LayerParams:
    """The parameters of decoder layer ``index`` (0-based); DeepSeek's first layers are dense."""
    return _layer(spec, spec.is_moe and index >= spec.first_dense_layers)


def layer_kinds(spec: ModelSpec, start: int = 0, stop: int | None = None) -> list[tuple[LayerParams, int]]:
    """The layers [start, stop) as (layer, how many) pairs: a model has at most two layer shapes."""
    stop = spec.num_layers if stop is None else stop
    dense = max(0, min(stop, spec.first_dense_layers if spec.is_moe else stop) - start)
    kinds = [(_layer(spec, False), dense), (_layer(spec, True), stop - start - dense)]
    return [(layer, n) for layer, n in kinds if n > 0]


@dataclass(frozen=True)
class Tensor:
    """Parameter tensors of one shape, as FSDP2 shards them (on dim 0) and Megatron splits them."""

    rows: int  # dim 0
    cols: int  # the other dimensions multiplied
    count: int  # how many tensors of this shape
    split: str  # Megatron: "tp" (tensor or vocabulary parallel), "ep" (routed experts), "" (replicated)


def tensors(
    spec: ModelSpec, start: int = 0, stop: int | None = None, *, embedding: bool = True, head: bool = True
) -> list[Tensor]:
    """The parameter tensors of decoder layers [start, stop), plus the embedding and the output
    head (untied) with the final norm when asked; their elements add up to the parameter count.

    Linear weights are (fan_out, fan_in); transformers fuses a layer's routed experts into
    ``gate_up_proj`` (E, 2f, h) and ``down_proj`` (E, h, f). A layer's norms count as one tensor
    (they are vectors of a few thousand values; only their sum matters here).
    """
    out: list[Tensor] = []
    for layer, n in layer_kinds(spec, start, stop):
        for lin in layer.linears:
            out.append(Tensor(lin.fan_out, lin.fan_in, n, "tp"))
            if lin.bias:
                out.append(Tensor(lin.fan_out, 1, n, "tp"))
        if layer.is_moe:
            h, f, e = spec.hidden_size, spec.expert_intermediate_size, spec.num_experts
            out += [Tensor(e, 2 * f * h, n, "ep"), Tensor(e, h * f, n, "ep")]
            if spec.mlp_bias:
                out += [Tensor(e, 2 * f, n, "ep"), Tensor(e, h, n, "ep")]
            out.append(Tensor(e, h, n, ""))  # router
        out.append(Tensor(layer.other, 1, n, ""))
    if embedding:
        out.append(Tensor(spec.vocab_size, spec.hidden_size, 1, "tp"))
        if spec.vision is not None:  # the vision tower sits before the decoder
            out += vision_tensors(spec.vision)
    if head:
        out.append(Tensor(spec.hidden_size, 1, 1, ""))  # final norm
        if not spec.tie_embeddings:
            out.append(Tensor(spec.vocab_size, spec.hidden_size, 1, "tp"))
    return out


def vision_tensors(v: VisionSpec) -> list[Tensor]:
    """The vision tower's tensors: the patch embedding, per block qkv, proj and the MLP's matrices (with the
    block's norms and biases as one vector), and the merger's two matrices (with its norm and biases)."""
    w, f, m = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
    mlp = [Tensor(f, w, 2 if v.arch == "qwen2_5_vl" else 1, ""), Tensor(w, f, 1, "")]
    matrices = 4 * w * w + sum(t.rows * t.cols * t.count for t in mlp)
    blocks = [Tensor(3 * w, w, 1, ""), Tensor(w, w, 1, ""), *mlp, Tensor(vision_block_params(v) - matrices, 1, 1, "")]
    out = [Tensor(v.hidden_size, v.patch_values, 1, "")]
    out += [Tensor(t.rows, t.cols, t.count * v.depth, "") for t in blocks]
    merger = [Tensor(m, m, 1, ""), Tensor(v.out_hidden_size, m, 1, "")]
    merger_vector = vision_merger_params(v) - m * m - v.out_hidden_size * m
    return [*out, *merger, Tensor(merger_vector, 1, 1, "")]


def expert_params(spec: ModelSpec) -> int:
    """Routed-expert parameters of the whole model (what expert parallelism splits)."""
    return sum(layer.experts * n for layer, n in layer_kinds(spec))


def lora_targets(targets: str) -> tuple[str, ...] | None:
    """Parse ``all-linear`` (None: every linear layer) or a comma list of module names."""
    if targets.strip() in ("", "all-linear", "all"):
        return None
    return tuple(t.strip() for t in targets.split(",") if t.strip())


_FUSED_MLP = ("gate_proj", "up_proj", "down_proj")


def lora_params(
    spec: ModelSpec,
    rank: int,
    targets: str = "all-linear",
    start: int = 0,
    stop: int | None = None,
    *,
    vision: bool = False,
) -> int:
    """Adapter parameters peft adds: rank x (fan_in + fan_out) per targeted linear layer.

    ``all-linear`` is every ``nn.Linear`` of the decoder layers (peft leaves the output head out).
    A name matches a module whose own name (the last dotted part) equals it, as peft matches.
    ``start``/``stop`` restrict the count to some decoder layers (a pipeline stage).

    MoE models follow peft (>= 0.18) on transformers 5, whose routed experts are fused 3-D
    parameters: targets ``gate_proj``/``up_proj``/``down_proj`` are moved onto the fused experts
    (``gate_up_proj`` at rank 2r: ``2r E (h + 2f)``; ``down_proj``: ``r E (f + h)``), so the dense
    layers' and shared experts' MLP linears get no adapter; ``gate`` (in all-linear) adapts the
    router: ``r (h + E)``.

    A VL model's vision tower gets adapters on all its linear layers when it is trained (``vision``, with
    all-linear: rlctl.engines.vision.language_linear_names); a frozen tower gets none.
    """
    if rank <= 0:
        return 0
    tower = vision_lora_params(spec.vision, rank) if vision and spec.vision and lora_targets(targets) is None else 0
    return tower + _text_lora_params(spec, rank, targets, start, stop)


def vision_lora_params(v: VisionSpec, rank: int) -> int:
    """Adapters on every linear layer of a vision tower: qkv, proj and the MLP per block, the merger's two."""
    w, f, m = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
    mlp = (3 if v.arch == "qwen2_5_vl" else 2) * (w + f)
    return rank * (v.depth * (4 * w + 2 * w + mlp) + 2 * m + m + v.out_hidden_size)


def _text_lora_params(spec: ModelSpec, rank: int, targets: str, start: int, stop: int | None) -> int:
    """lora_params of the decoder layers."""
    wanted = lora_targets(targets)
    names = set(wanted) if wanted is not None else lora_target_names(spec)
    if spec.is_moe:
        if 0 < len(names & {"gate_proj", "up_proj"}) < 2:
            raise UserError(
                "lora.targets: on a MoE model gate_proj and up_proj go together (fused gate_up_proj experts)"
            )
    total = 0
    for layer, n in layer_kinds(spec, start, stop):
        for lin in layer.linears:
            name = lin.name.rsplit(".", 1)[-1]
            if spec.is_moe and name in _FUSED_MLP:
                continue
            if name in names:
                total += n * rank * (lin.fan_in + lin.fan_out)
        if layer.is_moe:
            h, f, e = spec.hidden_size, spec.expert_intermediate_size, spec.num_experts
            per_layer = 0
            if "gate_proj" in names:
                per_layer += 2 * rank * e * (h + 2 * f)
            if "down_proj" in names:
                per_layer += rank * e * (f + h)
            if "gate" in names:
                per_layer += rank * (h + e)
            total += n * per_layer
    return total


def lora_target_names(spec: ModelSpec) -> set[str]:
    """Every module name a LoRA target list may use for this model (``gate`` is a MoE router)."""
    names = {lin.name.rsplit(".", 1)[-1] for layer, _ in layer_kinds(spec) for lin in layer.linears}
    return names | ({"gate", *_FUSED_MLP} if spec.is_moe else set())
