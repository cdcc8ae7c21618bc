"""`rlctl report RUN_DIR`: a run's summary and a PNG of its curves (matplotlib: the `plot` extra)."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

EXAMPLES = """
Examples:

  rlctl report runs/demo/grpo

  rlctl report runs/grpo-a --compare runs/grpo-b -o compare.png

  rlctl report runs/sft-x --json
"""


def report(
    run_dir: Annotated[str, typer.Argument(help="The run directory (--output-dir of sft / grpo / ppo).")],
    compare: Annotated[
        list[str] | None,
        typer.Option("--compare", help="Another run directory whose curves are overlaid, repeatable."),
    ] = None,
    output: Annotated[
        str | None,
        typer.Option("--output", "-o", help="Where the PNG goes (default: RUN_DIR/report.png)."),
    ] = None,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="Only the summary (no matplotlib needed).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summaries as one JSON object.")] = False,
) -> None:
    """Summarize a run (steps, time, tokens/s, first/last/best reward or loss, evals, checkpoints, HF
    export) and plot its curves (reward and its components, loss, KL, entropy, response length, tokens/s,
    eval) into a PNG; the plotted numbers go next to it as JSON (report.json)."""
    from pathlib import Path

    from rich.console import Console

    from rlctl.run_report import load_run, plot, render_summary, summarize

    runs = [load_run(run_dir)] + [load_run(p) for p in compare or []]
    summaries = [summarize(r) for r in runs]
    png = None
    if not no_plot:
        png = Path(output) if output else runs[0].paths.report_png
        sidecar = png.with_suffix(".json") if output else runs[0].paths.report_json
        plot(runs, png, sidecar=sidecar)
    if as_json:
        doc = {"runs": summaries, "png": str(png) if png else None}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    console = Console()
    for s in summaries:
        render_summary(console, s)
    if png is not None:
        console.print(f"curves: {png}  (plotted numbers: {png.with_suffix('.json')})", soft_wrap=True)
