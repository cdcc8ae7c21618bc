"""`rlctl presets list | show NAME`: the YAML presets shipped in the wheel."""

from __future__ import annotations

from typing import Annotated

import typer

app = typer.Typer(
    help="List and show the presets shipped with rlctl.",
    epilog="Examples:\n\n  rlctl presets list\n\n  rlctl presets show grpo\n\n  rlctl presets show tiers",
    no_args_is_help=True,
)


@app.command("list")
def list_() -> None:
    """List the presets: per-method defaults, named presets and the planner's hardware rules."""
    from rich.console import Console
    from rich.table import Table

    from rlctl.presets import list_presets

    table = Table(title="rlctl presets")
    table.add_column("name", style="bold")
    table.add_column("method")
    table.add_column("description")
    for name, doc in list_presets().items():
        table.add_row(name, doc.get("method", "-"), doc.get("description", ""))
    Console().print(table)


@app.command("show")
def show(name: Annotated[str, typer.Argument(help="Preset name, e.g. grpo.")]) -> None:
    """Print a preset's YAML (with the method's full resolved defaults for method presets)."""
    from rich.console import Console

    from rlctl.config import build_config
    from rlctl.presets import load_preset, method_layers

    doc = load_preset(name)
    console = Console()
    _print_yaml(console, doc)
    method = doc.get("method")
    if method and "config" in doc:
        cfg = build_config(method, method_layers(method, name))
        console.print(
            f"\n[bold]Resolved `{method}` configuration with this preset[/bold] (every key `--set` accepts):",
            soft_wrap=True,
        )
        _print_yaml(console, cfg.to_dict())


def _print_yaml(console, doc: dict) -> None:
    """YAML whose lines are never cropped: highlighted and wrapped on a terminal, plain text otherwise
    (a file or a pipe gets valid YAML)."""
    import yaml
    from rich.syntax import Syntax

    text = yaml.safe_dump(doc, sort_keys=False, width=10_000)
    if console.is_terminal:
        console.print(Syntax(text, "yaml", word_wrap=True))
    else:
        console.file.write(text)
        console.file.flush()
