"""The README's example outputs, generated from the CLI: each ``` block after a line starting with
:data:`MARK` is the output of the ``$ rlctl ...`` command it shows, run in this process at 100 columns
on a machine with no GPU and no optional package (so every machine generates the same text).
``python -m tests.support.readme`` rewrites README.md; tests/cli/test_readme.py fails when it drifts.
"""

from __future__ import annotations

import re
import shlex
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MARK = "<!-- generated from the CLI"  # ... (python -m tests.support.readme), optionally "tail=N" -->
BLOCK = re.compile(r"(?P<mark><!-- generated from the CLI[^\n]*-->\n)```\n(?P<body>.*?)```\n", re.S)


def run_example(command: str) -> str:
    """The console output of ``rlctl ...`` (the words after ``rlctl``), as a fresh laptop prints it."""
    from typer.testing import CliRunner

    from rlctl.cli.app import app
    from rlctl.plan.inputs import LocalEnv

    bare = LocalEnv()  # no GPU, nothing optional installed, host memory unknown
    with ExitStack() as stack:
        for where in ("rlctl.plan", "rlctl.plan.inputs", "rlctl.plan.advice"):
            try:
                stack.enter_context(mock.patch(f"{where}.detect_local", return_value=bare))
            except (AttributeError, ModuleNotFoundError):
                continue
        result = CliRunner().invoke(app, shlex.split(command)[1:], env={"COLUMNS": "100"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return "\n".join(line.rstrip() for line in result.output.splitlines())


def _block(mark: str, body: str) -> str:
    command = next(line[2:] for line in body.splitlines() if line.startswith("$ "))
    out = run_example(command).splitlines()
    tail = re.search(r"tail=(\d+)", mark)
    if tail and len(out) > int(tail.group(1)):
        out = ["...", *out[-int(tail.group(1)) :]]
    return mark + "```\n" + "\n".join([f"$ {command}", *out]) + "\n```\n"


def regenerate(text: str) -> str:
    """``text`` (README.md) with every marked block replaced by its command's output now."""
    return BLOCK.sub(lambda m: _block(m.group("mark"), m.group("body")), text)


if __name__ == "__main__":
    README.write_text(regenerate(README.read_text()))
    print(f"regenerated {len(BLOCK.findall(README.read_text()))} example outputs in {README}")
