"""`rlctl report RUN [RUN...]`: a run's summary, a self-contained HTML report (every metric, a rollout
browser) and a PNG of its curves (matplotlib: the `plot` extra)."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import typer

EXAMPLES = """
Examples:

  rlctl report runs/demo/grpo                  # summary, runs/demo/grpo/report.html and report.png

  rlctl report runs/grpo-a runs/grpo-b         # overlaid: runs/grpo-a/compare-grpo-b.html and .png

  rlctl report --follow runs/grpo-a            # rewrite the report every 10 s while the run goes on

  rlctl report runs/sft-x --json --no-plot
"""


def report(
    run_dirs: Annotated[
        list[str], typer.Argument(help="Run directories (--output-dir of sft / grpo / ppo); several are overlaid.")
    ],
    compare: Annotated[
        list[str] | None,
        typer.Option("--compare", help="Another run directory to overlay, repeatable (same as naming it after RUN)."),
    ] = None,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            help="Where the PNG goes; the HTML goes beside it as .html (default: RUN/report.png, or "
            "RUN/compare-OTHER.png for several runs).",
        ),
    ] = None,
    html: Annotated[bool, typer.Option("--html/--no-html", help="Write the HTML report (on by default).")] = True,
    no_plot: Annotated[bool, typer.Option("--no-plot", help="No PNG (no matplotlib needed).")] = False,
    smooth: Annotated[
        float, typer.Option("--smooth", min=0.0, max=0.99, help="EMA smoothing of the curves, 0 = raw (0-0.99).")
    ] = 0.6,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Rewrite the report every --interval seconds until the runs end.")
    ] = False,
    interval: Annotated[int, typer.Option("--interval", min=1, help="Seconds between rewrites with --follow.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summaries as one JSON object.")] = False,
) -> None:
    """Summarize runs (steps, time, tokens/s, first/last/best reward or loss, evals, checkpoints, HF
    export); write one HTML file with every logged metric (grouped, smoothed, zoomable, runs overlaid) and
    a rollout browser over samples.jsonl; draw the curves into a PNG, with the plotted numbers as JSON
    beside it."""
    from rich.console import Console

    from rlctl.run_report import load_run

    dirs = [*run_dirs, *(compare or [])]
    console = Console(stderr=as_json)
    outputs = _outputs([load_run(d) for d in dirs], output, html=html, png=not no_plot)
    while True:
        runs = [load_run(d) for d in dirs]
        running = follow and any(r.summary is None for r in runs)
        written = _write(runs, outputs, smooth=smooth, refresh_s=interval if running else 0, console=console)
        if not running:
            break
        console.print(f"[{time.strftime('%H:%M:%S')}] step {runs[0].train[-1]['step']}: {written}", soft_wrap=True)
        time.sleep(interval)
    _print(runs, written, as_json=as_json, console=console)


def _outputs(runs, output: str | None, *, html: bool, png: bool) -> dict:
    """{"png": Path | None, "json": ..., "html": ...}: a single run's report lives in the run; several
    runs get their own names (compare-OTHER...), so the first run's own report.png is never overwritten."""
    from pathlib import Path

    paths = runs[0].paths
    if output:
        base = Path(output).expanduser()
        pngp, jsonp = base.with_suffix(".png"), base.with_suffix(".json")
    elif len(runs) == 1:
        pngp, jsonp = paths.report_png, paths.report_json
        base = paths.report_html
    else:
        base = paths.root / ("compare-" + "-".join(r.name for r in runs[1:]))
        pngp, jsonp = base.with_suffix(".png"), base.with_suffix(".json")
    return {"png": pngp if png else None, "json": jsonp, "html": base.with_suffix(".html") if html else None}


def _write(runs, outputs: dict, *, smooth: float, refresh_s: int, console) -> str:
    """Write the HTML and the PNG; a missing matplotlib costs only the PNG (one note line)."""
    from rlctl.errors import UserError
    from rlctl.run_report import plot

    done = []
    if outputs["html"] is not None:
        from rlctl.viewer import write_html

        done.append(str(write_html(runs, outputs["html"], smooth=smooth, refresh_s=refresh_s)))
    if outputs["png"] is not None:
        try:
            plot(runs, outputs["png"], sidecar=outputs["json"], smooth=smooth)
            done.append(str(outputs["png"]))
        except UserError as e:
            if outputs["html"] is None or "matplotlib" not in str(e):
                raise
            console.print(f"note: no PNG: {e} (--no-plot skips it)", soft_wrap=True, highlight=False, markup=False)
    return ", ".join(done) or "nothing written"


def _print(runs, written: str, *, as_json: bool, console) -> None:
    from rlctl.run_report import render_summary, summarize

    summaries = [summarize(r) for r in runs]
    if as_json:
        files = written.split(", ")
        png = next((f for f in files if f.endswith(".png")), None)
        page = next((f for f in files if f.endswith(".html")), None)
        sys.stdout.write(json.dumps({"runs": summaries, "png": png, "html": page}, indent=2) + "\n")
        return
    for s in summaries:
        render_summary(console, s)
    console.print(f"report: {written}", soft_wrap=True, highlight=False, markup=False)
