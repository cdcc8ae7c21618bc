"""A rank's CUDA memory as torch's caching allocator and the device each see it (benchmarks/gpu_check.sh, G5 in
docs/gpu.md). Nothing on CPU.

- :func:`cuda_memory_peaks`: logged with every training step's metrics: torch's allocated / reserved peaks
  so far (``max_memory_allocated`` / ``max_memory_reserved``: what ``rlctl estimate`` calls allocated and
  reserved), the device's memory in use at that moment (``cudaMemGetInfo``: every process on the GPU, its
  CUDA context, NCCL's buffers, anything not allocated through torch) and what of that torch does not hold
  (``device used - reserved``). Each the busiest rank's (one all-reduce MAX).
- :func:`cuda_memory_now`: the same at one moment with the allocator's own counters (its fragmentation:
  ``inactive_split_bytes``, the cudaMalloc retries after freeing its cache: ``num_alloc_retries``); the fit
  loop reads it before and after the final checkpoint save, into summary.json (``cuda_memory``).
- ``RLCTL_CUDA_MEMORY_SNAPSHOT=FILE``: rank 0 records the allocator's history from the first step (python
  stacks, the last 100000 events) and dumps ``torch.cuda.memory._snapshot()`` to FILE after the final save
  (open it in https://pytorch.org/memory_viz). Costs a stack trace per allocation: for a check, not a run.

Telling them apart: a device-used figure far above the reserved peak with ``outside_torch_bytes`` large at a
step is memory torch never saw (context, NCCL); a reserved peak that rises across the save is the save's
own allocations through torch; reserved far above allocated is the cache (fragmentation if
``inactive_split_bytes`` is large).
"""

from __future__ import annotations

import os

SNAPSHOT_ENV = "RLCTL_CUDA_MEMORY_SNAPSHOT"
SNAPSHOT_ENTRIES = 100_000


def _max_over_ranks(values: list[int], device) -> list[int]:
    import torch

    t = torch.tensor(values, dtype=torch.int64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.tolist()


def outside_torch(device_used: int, reserved: int) -> int:
    """Bytes in use on the device that torch's caching allocator does not hold (never below 0: another
    process's release between the two reads)."""
    return max(0, device_used - reserved)


def cuda_memory_peaks(device) -> dict[str, int]:
    """On CUDA, the step record's memory keys (see the module docstring); {} elsewhere."""
    if device.type != "cuda":
        return {}
    import torch

    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    allocated_peak, reserved_peak, used, outside = _max_over_ranks(
        [
            torch.cuda.max_memory_allocated(device),
            torch.cuda.max_memory_reserved(device),
            total - free,
            outside_torch(total - free, reserved),
        ],
        device,
    )
    return {
        "mem/allocated_peak_bytes": allocated_peak,
        "mem/reserved_peak_bytes": reserved_peak,
        "mem/device_used_bytes": used,
        "mem/outside_torch_bytes": outside,
    }


def cuda_memory_now(device) -> dict[str, int]:
    """On CUDA, this moment's memory of the busiest rank (each figure its own max over ranks); {} elsewhere."""
    if device.type != "cuda":
        return {}
    import torch

    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    names = ["allocated", "reserved", "allocated_peak", "reserved_peak", "device_used", "outside_torch"]
    names += ["inactive_split", "alloc_retries"]
    reserved = stats.get("reserved_bytes.all.current", 0)
    values = [
        stats.get("allocated_bytes.all.current", 0),
        reserved,
        stats.get("allocated_bytes.all.peak", 0),
        stats.get("reserved_bytes.all.peak", 0),
        total - free,
        outside_torch(total - free, reserved),
        stats.get("inactive_split_bytes.all.current", 0),
        stats.get("num_alloc_retries", 0),
    ]
    maxed = _max_over_ranks(values, device)
    return {(f"{n}_bytes" if n != "alloc_retries" else n): v for n, v in zip(names, maxed)}


def start_snapshot(device, rank: int) -> bool:
    """``RLCTL_CUDA_MEMORY_SNAPSHOT`` set, on rank 0 of a CUDA run: start recording; whether it did."""
    if not os.environ.get(SNAPSHOT_ENV) or rank != 0 or device.type != "cuda":
        return False
    import torch

    torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, stacks="python")
    return True


def dump_snapshot(log) -> None:
    """Write the recorded history to ``$RLCTL_CUDA_MEMORY_SNAPSHOT`` and stop recording."""
    import torch

    path = os.environ[SNAPSHOT_ENV]
    try:
        torch.cuda.memory._dump_snapshot(path)
        log(f"CUDA memory snapshot: {path}")
    except OSError as e:
        log(f"warning: could not write the CUDA memory snapshot {path}: {e}")
    torch.cuda.memory._record_memory_history(enabled=None)
