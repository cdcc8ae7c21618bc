"""``RLCTL_PROFILE=START:END``: rank 0 runs ``torch.profiler`` over training steps START..END (1-based,
as ``step`` in metrics.jsonl; ``RLCTL_PROFILE=N`` is one step) and writes, after step END:

- ``RUN/profile/rank0.txt``: the operators' ``key_averages()`` table sorted by self CPU time (self CUDA
  time first on a GPU);
- ``RUN/profile/rank0.trace.json``: a chrome trace (open it in https://ui.perfetto.dev or chrome://tracing).

Steps 1-2 include one-time warm-up (allocations, first calls): profile later steps, e.g. ``3:6``.
`rlctl sft|grpo|ppo` refuse a malformed value before launch (one line, exit 2); on a rank started another
way it is one line in the log and no profile, never a failed run.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

PROFILE_ENV = "RLCTL_PROFILE"


def parse_steps(value: str) -> tuple[int, int] | None:
    """``"START:END"`` or ``"N"`` -> (START, END), 1-based and inclusive; None when empty or malformed."""
    value = value.strip()
    if not value:
        return None
    first, _, last = value.partition(":")
    try:
        start, end = int(first), int(last or first)
    except ValueError:
        return None
    return (start, end) if 1 <= start <= end else None


class StepProfiler:
    """Profiles steps START..END on rank 0; ``begin(step)`` before and ``end(step)`` after each 1-based step."""

    def __init__(self, root: Path, rank: int, log: Callable[[str], None] = print, env: str | None = None) -> None:
        value = os.environ.get(PROFILE_ENV, "") if env is None else env
        self.steps = parse_steps(value) if rank == 0 else None
        if rank == 0 and value.strip() and self.steps is None:
            log(f"warning: {PROFILE_ENV}={value!r} is not START:END (1-based steps, START <= END); no profile")
        self.out = Path(root) / "profile"
        self.log = log
        self._prof = None
        self._last = 0  # the last step begun inside the window (a run may stop before its END)

    def begin(self, step: int) -> None:
        self._last = step if self._prof is not None else self._last
        if self.steps is None or step != self.steps[0]:
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        self._last = step
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if _cuda_in_use(torch) else [])
        self._prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.__enter__()

    def end(self, step: int) -> None:
        if self._prof is None or step != self.steps[1]:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        self.write(prof)

    def close(self) -> None:
        """A run that stops inside the window still writes what it profiled."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            self.write(prof)

    def write(self, prof) -> None:
        import torch

        self.out.mkdir(parents=True, exist_ok=True)
        start, end = self.steps[0], self._last
        sort = "self_cuda_time_total" if _cuda_in_use(torch) else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=70)
        text = f"# rlctl profile of steps {start}..{end} (rank 0), sorted by {sort}\n{table}\n"
        (self.out / "rank0.txt").write_text(text)
        prof.export_chrome_trace(str(self.out / "rank0.trace.json"))
        self.log(f"profile of steps {start}..{end}: {self.out / 'rank0.txt'} and rank0.trace.json")


def _cuda_in_use(torch) -> bool:
    """The run computes on a GPU (a CPU run on a machine with one leaves CUDA uninitialised)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()
