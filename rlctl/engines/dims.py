"""The parallel dimensions of the FSDP engine, always present: :class:`ParallelDims`.

The ranks form a ``(dp, sp)`` grid: the ``sp`` consecutive ranks of a sequence-parallel group split each
sequence of the micro-batches they share (:mod:`rlctl.engines.ulysses`), the ranks with the same place in
their SP groups are the data-parallel replicas. ``sp`` 1 is the trivial grid: every rank its own replica,
data sums over the default group, no group of its own. FSDP2 shards the weights over every rank either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the ``(dp, sp)`` grid and the process groups of its row and column."""

    world: int
    rank: int
    sp: int = 1  # ranks per SP group
    sp_rank: int = 0  # this rank's place in its SP group
    sp_group: dist.ProcessGroup | None = None  # the SP group: consecutive ranks that split one sequence
    dp_group: dist.ProcessGroup | None = None  # the ranks at the same place of every SP group (None: every rank)

    @property
    def dp(self) -> int:
        """How many data-parallel replicas share the data."""
        return self.world // self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp


_GRIDS: dict[tuple[str, int], ParallelDims] = {}


def parallel_dims(sp: int, device_type: str) -> ParallelDims:
    """The grid of ``sp`` over the default group's ranks; sp 1 needs no process group of its own."""
    world, rank = dist.get_world_size(), dist.get_rank()
    return ParallelDims(world, rank) if sp == 1 else sp_grid(sp, device_type)


def sp_grid(sp: int, device_type: str) -> ParallelDims:
    """The grid with its process groups (built once per process; collective the first time). They are
    process groups of their own, never the default one, so attention's all-to-all does not queue behind
    FSDP2's all-gathers (on the default group)."""
    key = (device_type, sp)
    if key not in _GRIDS:
        world, rank = dist.get_world_size(), dist.get_rank()
        rows = [list(range(k * sp, (k + 1) * sp)) for k in range(world // sp)]
        columns = [list(range(j, world, sp)) for j in range(sp)]
        made = {tuple(ranks): dist.new_group(ranks) for ranks in rows + columns}  # every rank, in one order
        _GRIDS[key] = ParallelDims(
            world,
            rank,
            sp=sp,
            sp_rank=rank % sp,
            sp_group=made[tuple(rows[rank // sp])],
            dp_group=made[tuple(columns[rank % sp])],
        )
    return _GRIDS[key]
