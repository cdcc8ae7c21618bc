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


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    local_world_size: int = 1  # the processes of this node (torchrun's LOCAL_WORLD_SIZE)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str) -> Dist:
    """Start the default process group from torchrun's environment (gloo on CPU; nccl and gloo on CUDA,
    see :func:`process_group_backend`)."""
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
    if not dist.is_initialized():
        dist.init_process_group(
            process_group_backend(device_type),
            timeout=timedelta(minutes=30),
            device_id=device if device_type == "cuda" else None,
        )
    return Dist(rank, world, local, device, int(os.environ.get("LOCAL_WORLD_SIZE") or world))


def process_group_backend(device_type: str) -> str:
    """gloo on CPU; on CUDA nccl for CUDA tensors AND gloo for CPU ones: FSDP2's CPU offload keeps the
    sharded gradients as CPU DTensors, so clip-grad's norm reduction runs on CPU tensors (torch's
    ``CPUOffloadPolicy`` asks for ``"cpu:gloo,cuda:nccl"``), as do Megatron's CPU-offloaded optimizer and
    any object collective on CPU tensors. The gloo half costs one TCP store round per group."""
    return "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"


def check_rollout_in_node(tp: int, per_node: int) -> None:
    """A vLLM/SGLang engine runs tensor parallel inside one node, never across: its ranks are consecutive
    (torchrun numbers a node's processes consecutively), so ``tp`` must divide the processes of a node."""
    if tp > 1 and per_node % tp:
        raise UserError(
            f"rollout.tp={tp} would split a rollout engine across nodes ({per_node} processes per node); "
            f"tensor parallel stays inside a node: use a rollout.tp that divides {per_node} (--set rollout.tp=N)"
        )


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
