"""The GPU catalog and name resolution.

- ``memory_bytes`` is what torch reports as ``get_device_properties(i).total_memory`` (MiB x 2**20),
  the number the estimator compares against, not the marketing figure: an "80GB" H100 reports
  81089 MiB (79.2 GiB); ECC and driver reservations take the rest. It varies by a few MiB with the
  driver; the values are ones printed by torch on real machines. The marketing size stays in the name.
- ``bf16_tflops`` is the dense (no sparsity) bf16 tensor-core peak, for MFU.
- ``interconnect_gbps`` is the per-GPU GPU-to-GPU bandwidth as the vendor quotes it (both
  directions together): NVLink for SXM/HGX parts, the PCIe x16 link for PCIe cards.
- ``gpus_per_node`` is the usual server: 8 for HGX/SXM boards, 8 for PCIe H100/L40S/RTX 4090
  servers, 4 for A10G (AWS g5.12xlarge; g5.48xlarge has 8).
- ``host_memory_bytes`` is the CPU memory of such a node as clouds rent it (GiB as they list it),
  the budget for CPU offload: 2 TiB for HGX H100/H200/H20/B200 nodes (AWS p5/p5e.48xlarge and
  p6-b200.48xlarge, 2048 GiB; GCP a3-highgpu-8g and Azure ND H100 v5 have a little less), 1152 GiB
  for A100 nodes (AWS p4d/p4de.24xlarge; GCP a2 nodes have 680-1360 GB), 1 TiB for 8-GPU PCIe
  servers (H100 PCIe, L40S; AWS g6e.48xlarge has 1.5 TiB), 192 GiB for 4 x A10G (g5.12xlarge)
  and 256 GiB for 8 x RTX 4090 boxes. A rental of fewer GPUs gets its share of a node (a single
  H100 on AWS, p5.4xlarge, has 256 GiB = 2 TiB / 8); the estimator scales it that way.

No torch import here: the CLI uses this module for completion and --help.
"""

from __future__ import annotations

import re

from ..errors import UserError, did_you_mean
from .spec import GpuSpec

_MIB = 2**20
_GIB = 2**30

_GPUS: tuple[GpuSpec, ...] = (
    GpuSpec(
        "H100-80GB",
        81089 * _MIB,
        989.0,
        "NVLink",
        900.0,
        8,
        aliases=("H100", "H100-SXM", "H100-SXM5", "H100 80GB HBM3"),
        host_memory_bytes=2048 * _GIB,
    ),
    GpuSpec(
        "H100-PCIe-80GB",
        81008 * _MIB,
        756.0,
        "PCIe",
        128.0,
        8,
        aliases=("H100-PCIe", "H100 PCIe"),
        host_memory_bytes=1024 * _GIB,
    ),
    GpuSpec("H200-141GB", 143156 * _MIB, 989.0, "NVLink", 900.0, 8, aliases=("H200",), host_memory_bytes=2048 * _GIB),
    GpuSpec("H20-96GB", 97285 * _MIB, 148.0, "NVLink", 900.0, 8, aliases=("H20",), host_memory_bytes=2048 * _GIB),
    GpuSpec(
        "A100-40GB", 40536 * _MIB, 312.0, "NVLink", 600.0, 8, aliases=("A100-SXM4-40GB",), host_memory_bytes=1152 * _GIB
    ),
    GpuSpec(
        "A100-80GB",
        81050 * _MIB,
        312.0,
        "NVLink",
        600.0,
        8,
        aliases=("A100", "A100-SXM4-80GB"),
        host_memory_bytes=1152 * _GIB,
    ),
    GpuSpec("L40S", 45589 * _MIB, 362.0, "PCIe", 64.0, 8, aliases=("L40S-48GB",), host_memory_bytes=1024 * _GIB),
    GpuSpec("A10G", 22587 * _MIB, 125.0, "PCIe", 64.0, 4, aliases=("A10G-24GB",), host_memory_bytes=192 * _GIB),
    GpuSpec(
        "RTX-4090",
        24563 * _MIB,
        165.0,
        "PCIe",
        64.0,
        8,
        aliases=("4090", "RTX-4090-24GB", "GeForce RTX 4090"),
        host_memory_bytes=256 * _GIB,
    ),
    # China-market and other variants; memory as torch reports it on the same HBM stacks as their siblings
    GpuSpec(
        "A800-80GB",
        81050 * _MIB,
        312.0,
        "NVLink",
        400.0,
        8,
        aliases=("A800", "A800-SXM4-80GB"),
        host_memory_bytes=1152 * _GIB,
    ),
    GpuSpec(
        "H800-80GB",
        81089 * _MIB,
        989.0,
        "NVLink",
        400.0,
        8,
        aliases=("H800", "H800-SXM5"),
        host_memory_bytes=2048 * _GIB,
    ),
    GpuSpec(
        "H100-96GB",
        97871 * _MIB,
        989.0,
        "NVLink",
        900.0,
        8,
        aliases=("H100-SXM5-96GB", "GH200-96GB"),
        host_memory_bytes=2048 * _GIB,
    ),
    GpuSpec(
        "RTX-A6000",
        48676 * _MIB,
        155.0,
        "PCIe",
        64.0,
        8,
        aliases=("A6000", "RTX A6000"),
        host_memory_bytes=512 * _GIB,
    ),
    GpuSpec("L4", 22491 * _MIB, 121.0, "PCIe", 64.0, 8, aliases=("L4-24GB",), host_memory_bytes=192 * _GIB),
    GpuSpec(
        "B200",
        182642 * _MIB,
        2250.0,
        "NVLink",
        1800.0,
        8,
        aliases=("B200-180GB", "B200-192GB"),
        host_memory_bytes=2048 * _GIB,
    ),
)


def _normalize(name: str) -> str:
    """Case, separators and the vendor words of torch's device names do not matter:
    'NVIDIA H100 80GB HBM3', 'h100-80gb-hbm3' and 'H100_80GB_HBM3' are the same key."""
    name = re.sub(r"\b(nvidia|geforce)\b", "", name.lower())
    return re.sub(r"[^a-z0-9]", "", name)


def list_gpus() -> list[GpuSpec]:
    return list(_GPUS)


def resolve_gpu(name: str) -> GpuSpec:
    """A GPU by catalog name, alias or torch device name (case-insensitive)."""
    key = _normalize(name)
    for gpu in _GPUS:
        if key in {_normalize(n) for n in (gpu.name, *gpu.aliases)}:
            return gpu
    names = [g.name for g in _GPUS]
    raise UserError(f"unknown GPU '{name}'{did_you_mean(name, names)}; known GPUs: {', '.join(names)}")


def vllm_batch_limits(gpu_memory_bytes: int, gpu_name: str) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of vLLM 0.32's offline ``LLM`` on a GPU: 16384 tokens and
    1024 sequences from 70 GiB up (A100s excepted), 8192 and 256 below (``EngineArgs.get_batch_defaults``).
    rlctl's vLLM engine passes these explicitly, so the estimate and the engine agree."""
    if gpu_memory_bytes >= 70 * 2**30 and "a100" not in gpu_name.lower():
        return 16384, 1024
    return 8192, 256
