"""docs/multimodal.md's example runs: `python examples/vlm_colors/run.py --quick` (SFT, then GRPO with the
images, held-out accuracy before and after through plain transformers). The numbers of the full run are in
docs/multimodal.md and docs/benchmarks.md; here only that it runs and reports them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.cli import REPO


@pytest.mark.slow
def test_vlm_colors_example_quick(tmp_path):
    out, script = tmp_path / "vlm_colors", str(REPO / "examples" / "vlm_colors" / "run.py")
    res = subprocess.run(
        [sys.executable, script, "--quick", "--nproc", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "held-out accuracy, 16 pictures" in res.stdout and "after GRPO" in res.stdout
    assert (out / "grpo" / "hf" / "preprocessor_config.json").is_file()
    again = subprocess.run(  # the directory it made is replaced; any other is refused
        [sys.executable, script, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert again.returncode != 0 and "was not made by this example" in again.stderr
