"""A stand-in for a recipe (``RLCTL_TEST_RECIPE``): it has saved a checkpoint after step 2 and logged
step 3, then gets stuck: a first Ctrl-C is ignored (a save that takes long), so only a second one,
which kills the ranks, ends it. Used by tests/faults/test_interrupts.py."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from rlctl.runtime.layout import LATEST, TRAINER_STATE, RunPaths, step_name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    paths = RunPaths(Path(parser.parse_args().run_dir))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if int(os.environ["RANK"]) == 0:
        step = paths.checkpoints / step_name(2)
        step.mkdir(parents=True)
        (step / TRAINER_STATE).write_text(json.dumps({"step": 2, "method": "sft"}))
        (step / ".metadata").write_bytes(b"")
        (paths.checkpoints / LATEST).write_text(step.name + "\n")
        with open(paths.metrics, "a") as f:
            for s in (1, 2, 3):
                f.write(json.dumps({"step": s, "total_steps": 10, "loss": 1.0}) + "\n")
        (paths.root / "started").touch()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
