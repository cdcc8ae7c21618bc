"""`rlctl --version` imports nothing heavy (issue 37, item 15): no typer, rich, yaml nor any subcommand,
checked in a fresh interpreter through the real entry point; and the version it prints is the package's."""

from __future__ import annotations

import subprocess
import sys

from rlctl import __version__
from tests.support.cli import REPO, run_cli

PROBE = """
import sys
sys.argv = ["rlctl", "--version"]
from rlctl.cli.app import main
try:
    main()
except SystemExit:
    pass
print(sorted(m for m in sys.modules if m.split(".")[0] in ("typer", "click", "rich", "yaml", "pydantic", "psutil")
             or m.startswith("rlctl.cli.") and m != "rlctl.cli.app"))
"""


def test_version_imports_nothing_heavy():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines == [f"rlctl {__version__}", "[]"], out.stdout + out.stderr


def test_version_through_the_cli():
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout == f"rlctl {__version__}\n", r
