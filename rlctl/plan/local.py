"""What the machine printing the plan has: GPUs, host memory, optional packages.

:func:`detect_local` is cheap on purpose (it runs on every `rlctl ... --help`-free command): it
asks ``nvidia-smi -L`` when it is on PATH and ``importlib.util.find_spec`` for packages, and never
imports torch or CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache

# Optional packages the plan mentions: module name -> the pip extra that provides it.
OPTIONAL_PACKAGES = {
    "vllm": "rlctl[vllm]",
    "sglang": "rlctl[sglang]",
    "flash_attn": "rlctl[flash-attn]",
    "megatron": "rlctl[megatron]",
}


@dataclass(frozen=True)
class LocalEnv:
    gpu_count: int = 0
    gpu_name: str | None = None  # as nvidia-smi prints it, e.g. "NVIDIA H100 80GB HBM3"
    installed: frozenset[str] = field(default_factory=frozenset)  # importable module names
    memory_bytes: int = 0  # host memory (CPU plans), 0 = unknown


def _nvidia_smi() -> tuple[int, str | None]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0, None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0, None
    names = [line.split(":", 1)[1].split("(UUID", 1)[0].strip() for line in out.splitlines() if line.startswith("GPU ")]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = len(names) if visible is None else min(len(names), len([v for v in visible.split(",") if v.strip()]))
    return count, (names[0] if names and count else None)


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@lru_cache(maxsize=1)
def detect_local() -> LocalEnv:
    count, name = _nvidia_smi()
    installed = frozenset(m for m in OPTIONAL_PACKAGES if importlib.util.find_spec(m) is not None)
    return LocalEnv(gpu_count=count, gpu_name=name, installed=installed, memory_bytes=_host_memory())
