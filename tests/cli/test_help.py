"""--help shows what a first run needs, --help-all every option, and no option's name is ever cut (issue 37,
item 10). The real commands, in process (typer's runner), at terminal widths from 40 to 250 columns; the
names expected come from the table of flags (rlctl.cli.flags), not from the help's own rendering."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from rlctl.cli.flags import FIRST_RUN
from rlctl.cli.options import flags_of

COMMANDS = {
    **{m: [m] for m in ("sft", "grpo", "ppo", "dpo", "rm")},
    "estimate": ["estimate", "memory"],
}


def helps(args: list[str], width: int) -> str:
    from rlctl.cli.app import app

    r = CliRunner().invoke(app, args, env={"COLUMNS": str(width)})
    assert r.exit_code == 0, r.output
    return r.output


def names(command: str, *, first_run: bool = False) -> list[str]:
    """Every name of every option of ``command`` (an on/off switch: both), old hidden names left out."""
    out = []
    for flag in flags_of(command):
        if flag.alias_of or (first_run and flag.name not in FIRST_RUN):
            continue
        for decl in flag.names():
            out += decl.split("/")
    return out


def shown(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


@pytest.mark.parametrize("width", [40, 60, 80, 120, 250])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_all_shows_every_name_whole_at_any_width(command, width):
    text = helps([*COMMANDS[command], "--help-all"], width)
    missing = [n for n in names(command) if not shown(n, text)]
    assert not missing, (missing, text[:3000])
    assert "…" not in text and "..." not in text.split("Examples")[0].replace("e.g. ...", "")


@pytest.mark.parametrize("command", list(COMMANDS))
def test_help_shows_a_first_runs_options_and_where_the_rest_are(command):
    text = helps([*COMMANDS[command], "--help"], 80)
    everything = helps([*COMMANDS[command], "--help-all"], 80)
    first = names(command, first_run=True)
    assert first and all(shown(n, text) for n in first), [n for n in first if not shown(n, text)]
    rest, options = [n for n in names(command) if n not in first], text.split("Examples:")[0]
    assert rest and not any(shown(n, options) for n in rest), [n for n in rest if shown(n, options)]
    more = re.search(r"(\d+) more options: .*--help-all", text)
    assert more and int(more[1]) == len({f.name for f in flags_of(command) if not f.alias_of} - FIRST_RUN), text
    assert len(text.splitlines()) * 2 < len(everything.splitlines())


def test_grpo_help_at_80_columns_is_short():
    assert len(helps(["grpo", "--help"], 80).splitlines()) < 120  # was 430 lines with every option
