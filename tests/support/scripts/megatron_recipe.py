"""Run an rlctl recipe on the Megatron engine on CPU under gloo, for tests only.

    torchrun --nproc-per-node N recipe.py METHOD --run-dir RUN

The same as ``python -m rlctl.recipes.METHOD --run-dir RUN`` (what rlctl's launcher runs), with the
CPU patches of cpu_patches.py applied first in every rank (RUN/plan.json says backend megatron,
device cpu; the planner itself never plans Megatron on CPU).
"""

import os
import runpy
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).parent))

import megatron_cpu_patches  # noqa: F401  (before megatron.core)

if __name__ == "__main__":
    method = sys.argv.pop(1)
    runpy.run_module(f"rlctl.recipes.{method}", run_name="__main__", alter_sys=True)
