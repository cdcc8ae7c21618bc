"""The --help of the commands built from the table of flags: what a first run needs, the rest behind --help-all.

`rlctl grpo --help` shows the options of :data:`rlctl.cli.flags.FIRST_RUN` (and says how many more there
are); `--help-all` shows every option, by panel. An option's names are never cut, at any width: in a
terminal too narrow for names, type and help side by side, each option's names get a line of their own
(wrapped by the terminal if need be) and its help the lines below. No torch here.
"""

from __future__ import annotations

import typer
from typer.core import TyperCommand

HELP_ALL = "--help-all"
NAMES_MAX = 22  # longer names (an on/off switch's two) take a line of their own


def _names(param) -> str:
    names = ", ".join(param.opts)
    return names + (" / " + ", ".join(param.secondary_opts) if param.secondary_opts else "")


def _type(param, ctx) -> str:
    if param.secondary_opts or getattr(param, "is_flag", False):  # an on/off switch, a flag
        return ""
    shown = param.display_type_rich(ctx=ctx)
    return "" if shown is None else str(shown)


def _shown(param, everything: bool) -> bool:
    from rlctl.cli.flags import FLAGS

    return not param.hidden or (everything and param.name not in {f.name for f in FLAGS if f.alias_of})


def render_help(command: TyperCommand, ctx: typer.Context, *, everything: bool) -> None:
    """The help of ``command``: usage, description, options by panel, how to see the rest, examples."""
    from rich.console import Console
    from rich.padding import Padding
    from rich.table import Column, Table
    from rich.text import Text

    console = Console(highlight=False)
    console.print(Text(f"Usage: {ctx.command_path} [OPTIONS]", style="bold"))
    if command.help:
        console.print(Padding(Text(command.help.strip()), (1, 0, 0, 1)))
    params = [p for p in command.get_params(ctx) if p.opts and p.opts[0].startswith("-")]
    panels: dict[str, list] = {}
    for p in params:
        if _shown(p, everything):
            panels.setdefault(getattr(p, "rich_help_panel", None) or "Options", []).append(p)
    rows = [(_names(p), _type(p, ctx)) for ps in panels.values() for p in ps]
    names_w = max((len(n) for n, _ in rows if len(n) <= NAMES_MAX), default=NAMES_MAX)
    type_w = max(len(t) for _, t in rows)
    side_by_side = console.width >= names_w + type_w + 4 + 30
    for title, ps in panels.items():
        console.print(Text(f"\n{title}", style="bold"))
        table = None
        for p in ps:
            names, kind = _names(p), _type(p, ctx)
            if side_by_side and len(names) > names_w:  # its names on a line of their own, the rest below
                if table is not None:
                    console.print(Padding(table, (0, 0, 0, 1)))
                    table = None
                console.print(Text(" " + names, style="cyan"), soft_wrap=True)
                names = ""
            if not side_by_side:  # too narrow: names on a line of their own, never cut
                console.print(Text(" " + names + ("  " + kind if kind else ""), style="cyan"), soft_wrap=True)
                console.print(Padding(Text(p.help or "", overflow="fold"), (0, 0, 0, 5)))
                continue
            if table is None:
                table = Table.grid(
                    Column(no_wrap=True, min_width=names_w, max_width=names_w),
                    Column(no_wrap=True, min_width=type_w),
                    Column(ratio=1, overflow="fold"),
                    padding=(0, 2, 0, 0),
                    pad_edge=False,
                    expand=True,
                )
            table.add_row(Text(names, style="cyan"), Text(kind), Text(p.help or ""))
        if table is not None:
            console.print(Padding(table, (0, 0, 0, 1)))
    more = sum(not _shown(p, False) and _shown(p, True) for p in params)
    if more and not everything:
        console.print(Text(f"\n{more} more options: {ctx.command_path} {HELP_ALL}", style="bold"))
    if command.epilog:
        console.print(Text("\n" + command.epilog.strip("\n")), soft_wrap=True)  # commands whole: copy-paste


class FlagsCommand(TyperCommand):
    """A command whose --help is :func:`render_help` (and which takes --help-all)."""

    def format_help(self, ctx, formatter) -> None:
        render_help(self, ctx, everything=bool(ctx.meta.get(HELP_ALL)))


def help_all_option():
    """The ``--help-all`` parameter (eager: prints every option and exits)."""

    def show(ctx: typer.Context, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            ctx.meta[HELP_ALL] = True
            typer.echo(ctx.get_help(), nl=False)
            raise typer.Exit()

    return typer.Option(
        HELP_ALL,
        is_eager=True,
        expose_value=False,
        callback=show,
        help="Show every option (--help: a first run's).",
    )
