"""Distributed start-up and every collective the recipes use.

The recipes run under torchrun, one process per device; without torchrun's variables
:func:`init_distributed` starts a one-process group, so a recipe or a test can run alone. All the
sums, maxima and gathers of the trainers go through this module (float64 sums, so token counts stay
exact).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rlctl.errors import UserError
from rlctl.runtime.net import free_port
from rlctl.support import JobFacts, refuse


@dataclass(frozen=True)
class Split:
    """A run whose processes are split in two groups (``rollout.procs``, rlctl.recipes.rl.offpolicy): the
    first ``trainers`` processes train, the others only generate. Each group has its own default process
    group (its ranks count from 0); ``bridge`` (gloo, every process, global ranks) carries the generated
    samples, ``sync`` (trainer 0 and the rollout processes, trainer 0 is its rank 0; nccl on CUDA, gloo on
    CPU) the weights. ``sync`` is None on the trainers other than 0."""

    role: str  # "train" | "rollout"
    trainers: int
    rollouts: int
    global_rank: int
    bridge: dist.ProcessGroup
    sync: dist.ProcessGroup | None
    store: dist.Store | None = None  # torchrun's store (streaming runs poll their notices on it)


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int = 1  # the processes of this node (torchrun's LOCAL_WORLD_SIZE)
    split: Split | None = None  # rollout.procs > 0: this process's group (rank and world_size are the group's)

    @property
    def is_main(self) -> bool:
        """Rank 0 of the trainers: it logs, writes metrics and summary.json."""
        return self.rank == 0 and (self.split is None or self.split.role == "train")


#: The process groups made outside torch's registry (a split run's bridge and sync, :func:`init_split`):
#: ``destroy_process_group()`` does not know them, :func:`destroy_all` ends them.
_UNREGISTERED: list = []


def init_distributed(device_type: str, rollout_procs: int = 0, timeout: timedelta = timedelta(minutes=30)) -> Dist:
    """Start the default process group from torchrun's environment (gloo on CPU; nccl and gloo on CUDA,
    see :func:`process_group_backend`); with ``rollout_procs`` > 0 one per group (:func:`init_split`).
    ``timeout``: how long any collective of any group waits for its peers (``hardware.collective_timeout_min``)."""
    if device_type not in ("cpu", "cuda"):
        raise UserError(f"unknown device '{device_type}'; use cpu or cuda (hardware.device)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("the run asks for CUDA but no GPU is visible; pass --device cpu or run on a GPU machine")
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if device_type == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if rollout_procs > 0 and not dist.is_initialized():
        return init_split(device, rollout_procs, local, timeout)
    if not dist.is_initialized():
        dist.init_process_group(
            process_group_backend(device_type),
            timeout=timeout,
            device_id=device if device_type == "cuda" else None,
        )
    return Dist(rank, world, local, device, int(os.environ.get("LOCAL_WORLD_SIZE") or world))


def init_split(device: torch.device, rollout_procs: int, local_rank: int, timeout: timedelta) -> Dist:
    """The default process group of this process's group (trainers: the first ``world - rollout_procs``
    processes; rollout: the rest), and the two process groups between them (:class:`Split`), all over
    torchrun's one store. Every group waits ``timeout``: the rollout processes wait on ``sync`` through a
    whole update, the trainers on ``bridge`` through a whole rollout."""
    store, rank, world = next(dist.rendezvous("env://"))
    refuse(JobFacts(rollout_procs=rollout_procs, world=world), "split_trainer")
    trainers = world - rollout_procs
    role = "train" if rank < trainers else "rollout"
    group_rank, group_size = (rank, trainers) if role == "train" else (rank - trainers, rollout_procs)
    dist.init_process_group(
        process_group_backend(device.type),
        store=dist.PrefixStore(f"rlctl/{role}", store),
        rank=group_rank,
        world_size=group_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("rlctl/bridge", store), rank, world, timeout)
    sync = None
    if rank == 0 or role == "rollout":  # trainer 0 and the rollout processes
        sync_rank, sync_store = (0 if rank == 0 else rank - trainers + 1), dist.PrefixStore("rlctl/sync", store)
        if device.type == "cuda":  # not run on this project's CPU machines (tests/engines/test_gpu_faults.py)
            sync = dist.ProcessGroupNCCL(sync_store, sync_rank, rollout_procs + 1, nccl_options(timeout))
        else:
            sync = dist.ProcessGroupGloo(sync_store, sync_rank, rollout_procs + 1, timeout)
    _UNREGISTERED.extend(g for g in (sync, bridge) if g is not None)  # in the order destroy_all ends them
    split = Split(role, trainers, rollout_procs, rank, bridge, sync, dist.PrefixStore("rlctl/notice", store))
    os.environ.update(RANK=str(group_rank), WORLD_SIZE=str(group_size))  # libraries that read them see the group
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    return Dist(group_rank, group_size, local_rank, device, min(local_world, group_size), split)


def nccl_options(timeout: timedelta):
    """The options of an NCCL group made by its constructor, as ``new_group`` would set them (torch c10d,
    ``_new_process_group_helper``): without them the group gets NCCL's default 10-minute watchdog, which
    kills the run when a peer waits longer (a rollout process waiting through a long update)."""
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return options


def destroy_all() -> None:
    """End every process group of this process: those torch does not know (:data:`_UNREGISTERED`, NCCL
    communicators otherwise left to the interpreter's exit), then torch's own."""
    while _UNREGISTERED:
        _UNREGISTERED.pop(0).shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def process_group_backend(device_type: str) -> str:
    """gloo on CPU; on CUDA nccl for CUDA tensors AND gloo for CPU ones: FSDP2's CPU offload keeps the
    sharded gradients as CPU DTensors, so clip-grad's norm reduction runs on CPU tensors (torch's
    ``CPUOffloadPolicy`` asks for ``"cpu:gloo,cuda:nccl"``), as do Megatron's CPU-offloaded optimizer and
    any object collective on CPU tensors. The gloo half costs one TCP store round per group."""
    return "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"


def check_rollout_in_node(tp: int, per_node: int) -> None:
    """On the ranks: a rollout engine's tensor parallel stays inside a node (rlctl.support.rollout_tp_node)."""
    refuse(JobFacts(rollout_tp=tp, world=per_node), "rollout_tp_node")


def _alone(group: dist.ProcessGroup | None) -> bool:
    """No collective to run: no process group, or ``group`` (default: all) is this rank alone. A gloo
    collective costs ~0.1 ms even with one rank; a step runs several."""
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float], device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """Sum a few floats over the ranks of ``group`` (default: all) in one collective (float64 for exact
    token counts). Sums over the data use the engine's ``dp_group``."""
    if _alone(group):
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def all_reduce_max(value: int, device: torch.device, group: dist.ProcessGroup | None = None) -> int:
    if _alone(group):
        return int(value)
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def global_sums(
    values: dict[str, float], device: torch.device, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Sum a dict of floats over the ranks of ``group`` (default: all; every rank must pass the same keys)."""
    keys = sorted(values)
    return dict(zip(keys, all_reduce_sum([float(values[k]) for k in keys], device, group)))


def all_gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    """``obj`` of every rank of ``group`` (default: all), in rank order (picklable objects)."""
    if _alone(group):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
