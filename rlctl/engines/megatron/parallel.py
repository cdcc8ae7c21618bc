"""Pure layout math of the Megatron engine: which global ranks form which groups, and what a layout needs.

No torch and no megatron-core here, so the planner, the CLI and tests can use it anywhere.

megatron-core orders the dense (non-expert) parallel dimensions ``tp-cp-dp-pp`` (its default order
``tp-cp-ep-dp-pp`` with the expert dimension folded into dp): tensor-parallel ranks are the fastest
varying, pipeline stages the slowest. A global rank is::

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so on 8 GPUs with tp=2, pp=2 (dp=2): TP groups [0,1] [2,3] [4,5] [6,7], DP groups [0,2] [1,3] [4,6] [5,7],
PP groups [0,4] [1,5] [2,6] [3,7]. A TP group therefore stays inside one node whenever tp divides the
GPUs per node (the planner keeps tp <= GPUs per node).
"""

from __future__ import annotations

from typing import Any

from rlctl.catalog.parallel import pipeline_split, tp_problem, valid_tps
from rlctl.errors import UserError
from rlctl.support import JobFacts, refuse

#: CUDA_DEVICE_MAX_CONNECTIONS=1 makes the GPU run kernels in launch order, which megatron-core's
#: overlap of TP / sequence-parallel communication with compute relies on.
CUDA_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def rank_coords(rank: int, world: int, tp: int, pp: int, cp: int = 1) -> dict[str, int]:
    """The (tp, cp, dp, pp) ranks of global ``rank``."""
    dp = data_parallel_size(world, tp, pp, cp)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a world of {world}")
    tp_rank, rest = rank % tp, rank // tp
    cp_rank, rest = rest % cp, rest // cp
    dp_rank, pp_rank = rest % dp, rest // dp
    return {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank}


def data_parallel_size(world: int, tp: int, pp: int, cp: int = 1) -> int:
    if min(world, tp, pp, cp) < 1:
        raise UserError(f"world, tp, pp and cp must be >= 1 (got world={world} tp={tp} pp={pp} cp={cp})")
    refuse(JobFacts(world=world, tp=tp, pp=pp, cp=cp), "megatron_grid")
    return world // (tp * pp * cp)


def rank_layout(world: int, tp: int, pp: int, cp: int = 1) -> dict[str, Any]:
    """Every process group of a ``world``-rank job, as megatron-core's parallel_state builds them.

    Returns ``{"dp": int, "tp": [[ranks]...], "cp": ..., "dp_groups": ..., "dp_cp": ..., "pp": ...,
    "embedding": ..., "coords": [per-rank coords]}`` where each group list is sorted by its first rank.
    ``dp_cp`` is the group DDP reduces gradients over (data and context parallel ranks together);
    ``embedding`` holds the first and last stage of each pipeline (they sync tied embeddings).
    """
    dp = data_parallel_size(world, tp, pp, cp)
    coords = [rank_coords(r, world, tp, pp, cp) for r in range(world)]

    def groups(*varying: str) -> list[list[int]]:
        fixed: dict[tuple, list[int]] = {}
        for r, c in enumerate(coords):
            fixed.setdefault(tuple(v for k, v in c.items() if k not in varying), []).append(r)
        return sorted(fixed.values())

    pp_groups = groups("pp")
    return {
        "dp": dp,
        "tp": groups("tp"),
        "cp": groups("cp"),
        "dp_groups": groups("dp"),
        "dp_cp": groups("dp", "cp"),
        "pp": pp_groups,
        "embedding": [sorted({g[0], g[-1]}) for g in pp_groups],
        "coords": coords,
    }


def pipeline_stages(num_layers: int, pp: int) -> list[int]:
    """Decoder layers of each pipeline stage: even stages, or (when pp does not divide the layers) even
    stages and a last one with fewer, megatron-core's ``num_layers_in_last_pipeline_stage`` (61 layers
    in 16 stages: 15 x 4 + 1). UserError naming the valid pp when there is no such split."""
    refuse(JobFacts(pp=pp, layers=num_layers), "megatron_pp")
    return pipeline_split(num_layers, pp)


def layer_stages(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """(pipeline stage, layer index within the stage) of every decoder layer, in order."""
    return [(stage, local) for stage, n in enumerate(pipeline_stages(num_layers, pp)) for local in range(n)]


def check_megatron_layout(layout_cfg, *, world: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> None:
    """UserError, naming what would work, for a layout megatron-core (or rlctl's engine) cannot run.

    ``layout_cfg`` is a :class:`rlctl.formats.megatron_layout.MegatronLayoutConfig` (heads, kv heads,
    ffn and layers); tp must divide the heads, kv heads and ffn, pp must split the layers
    (:func:`pipeline_stages`), tp x pp x cp must divide the world.
    """
    c = layout_cfg
    problem = tp_problem(tp, c.num_heads, c.num_kv_heads, c.ffn_hidden_size)
    if problem:
        valid = valid_tps(c.num_kv_heads, c.num_heads, c.num_kv_heads, c.ffn_hidden_size)
        raise UserError(
            f"tp={tp}: {problem} of the model (replicating kv heads is not supported); "
            f"valid tp: {', '.join(map(str, valid))}"
        )
    pipeline_stages(c.num_layers, pp)
    data_parallel_size(world, tp, pp, cp)
    if ep > 1:
        raise UserError(
            f"ep={ep}: expert parallelism needs a MoE model, and rlctl's Megatron engine maps dense "
            f"models only (Qwen2/Qwen2.5/Qwen3/Llama/Mistral); use ep=1"
        )
    if cp > 1:
        raise UserError(
            f"cp={cp}: context parallelism is not supported by rlctl's Megatron engine yet; use cp=1 "
            f"(and tp/pp for memory)"
        )


def megatron_env(*, backend: str, device: str, tp: int, sequence_parallel: bool) -> dict[str, str]:
    """Environment variables a Megatron job needs on every rank (set before CUDA starts)."""
    if backend != "megatron" or device != "cuda":
        return {}
    if tp > 1 or sequence_parallel:
        return {CUDA_MAX_CONNECTIONS: "1"}
    return {}
