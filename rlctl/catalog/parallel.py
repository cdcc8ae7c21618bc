"""How a model can be split over ranks: the arithmetic of tensor, pipeline and context parallelism.

One set of rules for the planner (before launch, from the catalog), the Megatron engine (on the ranks,
from the HF config) and the converter (rlctl's TP/PP shard files). Each returns the problem as a phrase,
or None, and the caller names its own option and the valid values in its one-line error. Pure
arithmetic, no torch.
"""

from __future__ import annotations

#: the sizes the planner tries (and names as valid) for parallel dimensions that split by powers of two
POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def tp_problem(tp: int, heads: int, kv_heads: int | None = None, ffn: int | None = None) -> str | None:
    """Why ``tp`` cannot split the attention heads, the KV heads (None: not split, e.g. MLA) or the
    FFN (None: not checked); None when it can."""
    if tp < 1:
        return f"{tp} is not a size (tp >= 1)"
    if heads % tp:
        return f"{tp} does not divide the {heads} attention heads"
    if kv_heads is not None and kv_heads % tp:
        return f"{tp} does not divide the {kv_heads} KV heads"
    if ffn is not None and ffn % tp:
        return f"{tp} does not divide the FFN size {ffn}"
    return None


def valid_tps(limit: int, heads: int, kv_heads: int | None = None, ffn: int | None = None) -> list[int]:
    return [t for t in range(1, limit + 1) if tp_problem(t, heads, kv_heads, ffn) is None]


def pipeline_split(num_layers: int, pp: int) -> list[int] | None:
    """Layers per pipeline stage, or None when ``pp`` cannot split ``num_layers``.

    Even stages when ``pp`` divides the layers; otherwise the other stages stay even and the last
    one holds fewer layers (Megatron's ``num_layers_in_last_pipeline_stage``), e.g. 61 layers in 16
    stages = 15 x 4 + 1. The last stage also computes the output head and the loss.
    """
    if pp < 1 or pp > num_layers:
        return None
    if num_layers % pp == 0:
        return [num_layers // pp] * pp
    for last in range(num_layers // pp, 0, -1):
        if (num_layers - last) % (pp - 1) == 0 and last <= (num_layers - last) // (pp - 1):
            return [(num_layers - last) // (pp - 1)] * (pp - 1) + [last]
    return None


def valid_pps(num_layers: int, *, even: bool = False) -> list[int]:
    """Pipeline sizes that split ``num_layers`` (``even``: every stage the same size)."""
    return [p for p in range(1, num_layers + 1) if (num_layers % p == 0 if even else pipeline_split(num_layers, p))]


def world_problem(world: int, tp: int, pp: int, cp: int = 1) -> str | None:
    """Why ``world`` ranks cannot hold whole tp x pp x cp model replicas; None when they can."""
    unit = tp * pp * cp
    if min(world, tp, pp, cp) < 1:
        return f"world, tp, pp and cp must be >= 1 (got world={world} tp={tp} pp={pp} cp={cp})"
    if world % unit:
        return f"tp {tp} x pp {pp} x cp {cp} = {unit} does not divide {world}"
    return None


def sp_problem(sp: int, world: int, heads: int, kv_heads: int | None = None) -> str | None:
    """Why Ulysses sequence parallelism of size ``sp`` cannot run on ``world`` ranks of a model with
    ``heads`` attention heads and ``kv_heads`` KV heads (None: not checked); None when it can.

    The all-to-all gives each rank ``heads / sp`` query heads; KV heads are split the same way, or each
    repeated ``sp / kv_heads`` times where there are fewer KV heads than ``sp``."""
    if sp < 1:
        return f"{sp} is not a size (sp >= 1)"
    if world % sp:
        return f"{sp} does not divide the {world} ranks"
    if heads % sp:
        return f"{sp} does not divide the {heads} attention heads"
    if kv_heads is not None and kv_heads % sp and sp % kv_heads:
        return f"{sp} neither divides nor is a multiple of the {kv_heads} KV heads"
    return None


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


#: Rollout engines that run one copy per rank (no tensor parallelism): the hf engine (one device), and
#: rlctl's SGLang adapter (one offline engine per torchrun rank: SGLang's own TP workers would be
#: processes of their own, outside the trainer's world).
SINGLE_DEVICE_ROLLOUT_ENGINES = ("hf", "sglang")


def rollout_engine_tp_problem(engine: str, tp: int) -> str | None:
    """Why the rollout engine ``engine`` cannot run with tensor parallelism ``tp``; None when it can."""
    if tp > 1 and engine in SINGLE_DEVICE_ROLLOUT_ENGINES:
        return f"the {engine} rollout engine runs one copy per rank (tp 1)"
    return None


def sp_kv_heads(sp: int, kv_heads: int) -> int:
    """KV heads Ulysses SP exchanges: the model's, or ``sp`` when there are fewer and each is repeated."""
    return max(kv_heads, sp)
