"""A stand-in for a recipe, run by the real launcher under torchrun (``RLCTL_TEST_RECIPE``): rank 0 logs
steps 1-4 to metrics.jsonl, holding on after step 1 until the file named by ``RLCTL_TEST_GO`` exists (at
most 120 s), then writes summary.json as a finished run does. Used by tests/faults/test_run_lock.py to keep
one run alive while another starts in the same directory."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from rlctl.runtime.layout import RunPaths, write_json_atomic


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    paths = RunPaths(Path(parser.parse_args().run_dir))
    if int(os.environ["RANK"]) != 0:
        return
    go, deadline = Path(os.environ["RLCTL_TEST_GO"]), time.monotonic() + 120
    for step in (1, 2, 3, 4):
        with open(paths.metrics, "a") as f:
            f.write(json.dumps({"step": step, "total_steps": 4, "loss": 1.0, "pid": os.getppid()}) + "\n")
        while step == 1 and not go.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    write_json_atomic(paths.summary, {"status": "completed", "step": 4, "checkpoint": None})


if __name__ == "__main__":
    main()
