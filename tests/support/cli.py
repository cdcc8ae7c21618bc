"""Running rlctl as a user would: `python -m rlctl ...` in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_cli(
    *args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    """Run `python -m rlctl ...` in a subprocess, as a user would."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "rlctl", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def rlctl_in_process(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """Run ``rlctl ARGS`` in this process (the real entry point, ``rlctl.cli.app.main``): (exit code,
    stdout + stderr). Milliseconds instead of a new interpreter's seconds."""
    import pytest

    from rlctl.cli.app import main

    monkeypatch.setattr(sys, "argv", ["rlctl", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    out = capsys.readouterr()
    return int(exited.value.code or 0), out.out + out.err


def one_line_error(code: int, text: str) -> str:
    """The only line of a failed command's output: ``error: ...`` with exit status 2."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert code == 2, text[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), text[-3000:]
    return lines[0]


def convert_cli(*args: str) -> tuple[int, str]:
    """Run the `rlctl convert` sub-app in-process like the real entry point: (exit code, stderr+stdout); a
    UserError is exit code 2 and its message; any other exception propagates."""
    import typer
    from typer.testing import CliRunner

    from rlctl.cli.convert import app
    from rlctl.errors import UserError

    result = CliRunner().invoke(app, list(args))
    if isinstance(result.exception, UserError):
        return 2, str(result.exception)
    if result.exception is not None and not isinstance(result.exception, (SystemExit, typer.Exit)):
        raise result.exception
    return result.exit_code, result.output
