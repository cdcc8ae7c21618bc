"""The result of an estimate: :class:`MemoryEstimate`, its :class:`Phase` s, and their dict forms."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlctl.estimate.settings import ALLOCATOR_SLACK, GIB, HOST_MARGIN_FRACTION, MemorySettings, check_keys

# outside torch's caching allocator: the CUDA context, and the rollout engine's own preallocated pools
NOT_CACHED = frozenset(
    {"cuda_context", "engine_weights", "engine_packed_weights", "kv_cache", "engine_activations", "cuda_graphs"}
)
# freed and reallocated every micro batch in blocks of changing sizes: where the allocator's cache grows
TRANSIENT = frozenset({"activations", "vision_activations", "logits", "unsharded_buffers", "sp_all_to_all"})


@dataclass
class Phase:
    """One phase of the job on the busiest GPU: its memory by component.

    ``allocated_bytes`` is what torch's ``max_memory_allocated`` would report (the tensors alive at
    the peak), ``reserved_bytes`` what ``max_memory_reserved`` would (the caching allocator's slack on
    top), and ``total_bytes`` what the device holds (reserved, the engine's pools and the CUDA
    context, as nvidia-smi shows it): the fits verdict uses ``total_bytes``.
    """

    components: dict[str, int]
    note: str = ""
    slack: float = ALLOCATOR_SLACK  # of the transient components; 0 for host memory (pinned blocks counted exactly)

    @property
    def allocated_bytes(self) -> int:
        return sum(v for k, v in self.components.items() if k not in NOT_CACHED)

    @property
    def reserved_bytes(self) -> int:
        transient = sum(v for k, v in self.components.items() if k in TRANSIENT)
        return self.allocated_bytes + math.ceil(transient * self.slack)

    @property
    def total_bytes(self) -> int:
        return self.reserved_bytes + sum(v for k, v in self.components.items() if k in NOT_CACHED)

    def to_dict(self) -> dict:
        return {
            "components": dict(self.components),
            "allocated_bytes": self.allocated_bytes,
            "reserved_bytes": self.reserved_bytes,
            "total_bytes": self.total_bytes,
            "note": self.note,
            "slack": self.slack,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Phase:
        """The inverse of :meth:`to_dict` (the byte totals are derived, so not read back)."""
        check_keys(
            "memory phase", d, ("components", "allocated_bytes", "reserved_bytes", "total_bytes", "note", "slack")
        )
        return cls({str(k): int(v) for k, v in d["components"].items()}, d["note"], float(d["slack"]))


def component_rows(phases: dict[str, Phase]) -> list[tuple[str, list[int]]]:
    """A table of components by phase: (component, its bytes in each phase) for every component of any phase,
    in order of first appearance; a component that is 0 in every phase is left out."""
    components: list[str] = []
    for phase in phases.values():
        components += [c for c in phase.components if c not in components]
    rows = [(comp, [phase.components.get(comp, 0) for phase in phases.values()]) for comp in components]
    return [(comp, cells) for comp, cells in rows if any(cells)]


@dataclass
class MemoryEstimate:
    model: str
    params: int
    trainable_params: int
    gpu: str
    gpu_memory_bytes: int
    settings: MemorySettings
    phases: dict[str, Phase]
    kv_cache_bytes: int = 0  # per GPU, rollout engine
    kv_bytes_per_token: int = 0  # per GPU
    kv_cache_tokens: int = 0  # tokens the engine's KV cache holds (per engine replica)
    kv_cache_sequences: int = 0  # prompt+response sequences that fit in it at once
    host_phases: dict[str, Phase] = field(default_factory=dict)  # host memory of the busiest node (GPU runs)
    host_memory_bytes: int = 0  # host memory of one node available to the job; 0 = unknown, not checked
    assumptions: list[str] = field(default_factory=list)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda name: self.phases[name].total_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.phases[self.peak_phase].total_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_memory_bytes - self.peak_bytes

    @property
    def engine_starts(self) -> bool:
        """False when the engine's memory share leaves no room for a KV cache."""
        return not self.settings.is_rl or self.kv_cache_sequences >= 1

    @property
    def host_peak_phase(self) -> str | None:
        return max(self.host_phases, key=lambda name: self.host_phases[name].total_bytes) if self.host_phases else None

    @property
    def host_bytes(self) -> int:
        """Host memory the busiest node's processes use at their peak."""
        phase = self.host_peak_phase
        return self.host_phases[phase].total_bytes if phase else 0

    @property
    def host_limit_bytes(self) -> int:
        """Host memory a node may use: all of it but the margin kept for the system."""
        return int(self.host_memory_bytes * (1 - HOST_MARGIN_FRACTION))

    @property
    def host_fits(self) -> bool:
        return not self.host_memory_bytes or self.host_bytes <= self.host_limit_bytes

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0 and self.engine_starts and self.host_fits

    @property
    def problems(self) -> list[str]:
        """Why the job does not fit, one entry per limit it overflows (empty when it fits)."""
        problems = []
        if not self.engine_starts:
            problems.append(
                f"the rollout engine has no room for one {self.settings.seq_len}-token sequence of KV cache "
                f"(raise the memory fraction, the rollout TP, or offload the trainer)"
            )
        elif self.headroom_bytes < 0:
            problems.append(
                f"the {self.peak_phase} phase needs {self.peak_bytes / GIB:.1f} GiB per GPU, "
                f"the {self.gpu} has {self.gpu_memory_bytes / GIB:.1f} GiB"
            )
        if not self.host_fits:
            problems.append(
                f"host memory: the {self.host_peak_phase} phase needs {self.host_bytes / GIB:.1f} GiB per node, "
                f"a node has {self.host_memory_bytes / GIB:.0f} GiB ({self.host_limit_bytes / GIB:.1f} GiB usable "
                f"after the {HOST_MARGIN_FRACTION:.0%} kept for the system)"
            )
        return problems

    @property
    def fit_summary(self) -> str:
        """The peak and the headroom, in words (what the verdict says after "fits: ")."""
        peak, total = self.peak_bytes / GIB, self.gpu_memory_bytes / GIB
        share = self.headroom_bytes / self.gpu_memory_bytes
        tight = " (tight: allocator fragmentation may not fit)" if share < 0.05 else ""
        host = (
            f"; host {self.host_bytes / GIB:.0f} of {self.host_memory_bytes / GIB:.0f} GiB per node"
            if self.host_memory_bytes
            else ""
        )
        phase = self.phases[self.peak_phase]
        return (
            f"peak {peak:.1f} GiB ({self.peak_phase}: {phase.allocated_bytes / GIB:.1f} allocated, "
            f"{phase.reserved_bytes / GIB:.1f} reserved by torch, plus the CUDA context and engine pools) "
            f"of {total:.1f} GiB, {share:.0%} headroom{tight}{host}"
        )

    @property
    def verdict(self) -> str:
        problems = self.problems
        return "does not fit: " + "; ".join(problems) if problems else "fits: " + self.fit_summary

    def to_dict(self) -> dict:
        return {
            "model": self.model,
            "params": self.params,
            "trainable_params": self.trainable_params,
            "gpu": self.gpu,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "settings": self.settings.to_dict(),
            "phases": {name: phase.to_dict() for name, phase in self.phases.items()},
            "peak_phase": self.peak_phase,
            "peak_bytes": self.peak_bytes,
            "headroom_bytes": self.headroom_bytes,
            "fits": self.fits,
            "verdict": self.verdict,
            "kv_cache_bytes": self.kv_cache_bytes,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_cache_tokens": self.kv_cache_tokens,
            "kv_cache_sequences": self.kv_cache_sequences,
            "host_phases": {name: phase.to_dict() for name, phase in self.host_phases.items()},
            "host_bytes": self.host_bytes,
            "host_memory_bytes": self.host_memory_bytes,
            "host_fits": self.host_fits,
            "assumptions": list(self.assumptions),
        }

    @classmethod
    def from_dict(cls, d: dict) -> MemoryEstimate:
        """The inverse of :meth:`to_dict`: the derived keys (peak, headroom, verdict...) are computed
        again, not read; an unknown or missing key is a UserError."""
        check_keys("memory estimate", d, _ESTIMATE_KEYS)
        return cls(
            model=d["model"],
            params=d["params"],
            trainable_params=d["trainable_params"],
            gpu=d["gpu"],
            gpu_memory_bytes=d["gpu_memory_bytes"],
            settings=MemorySettings.from_dict(d["settings"]),
            phases={name: Phase.from_dict(p) for name, p in d["phases"].items()},
            kv_cache_bytes=d["kv_cache_bytes"],
            kv_bytes_per_token=d["kv_bytes_per_token"],
            kv_cache_tokens=d["kv_cache_tokens"],
            kv_cache_sequences=d["kv_cache_sequences"],
            host_phases={name: Phase.from_dict(p) for name, p in d["host_phases"].items()},
            host_memory_bytes=d["host_memory_bytes"],
            assumptions=list(d["assumptions"]),
        )


_ESTIMATE_KEYS = (
    "model",
    "params",
    "trainable_params",
    "gpu",
    "gpu_memory_bytes",
    "settings",
    "phases",
    "peak_phase",
    "peak_bytes",
    "headroom_bytes",
    "fits",
    "verdict",
    "kv_cache_bytes",
    "kv_bytes_per_token",
    "kv_cache_tokens",
    "kv_cache_sequences",
    "host_phases",
    "host_bytes",
    "host_memory_bytes",
    "host_fits",
    "assumptions",
)
