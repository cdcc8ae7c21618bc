"""Memory estimates of whole post-training jobs (trainer and rollout engine together), before
they run. See docs/estimate.md for every formula and its source."""

from rlctl.estimate.memory import MemoryEstimate, MemorySettings, Phase, estimate_memory

__all__ = ["MemoryEstimate", "MemorySettings", "Phase", "estimate_memory"]
