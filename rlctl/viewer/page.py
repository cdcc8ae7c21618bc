"""`rlctl report --html`: every metric a run logged, grouped, smoothed, zoomable, runs overlaid in
distinct colours, and a rollout browser over samples.jsonl, in ONE file that needs no network.

The page is a template (``report.js``, ``report.css`` beside this module) and the runs' records as JSON
in a ``<script type="application/json">`` element; the script draws SVG charts from it. Which metric
goes in which section is :data:`rlctl.run_report.PANELS`, the same table the PNG draws from.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from rlctl.run_report import EVAL_NOT_PLOTTED, NOT_PLOTTED, PANELS, Run, numeric_keys, panel_of, summarize

HERE = Path(__file__).resolve().parent
MAX_SAMPLES = 20_000  # samples.jsonl records embedded per run (the newest kept): the page stays a few MB


def _clean(value):
    """JSON without NaN/inf tokens (a browser's JSON.parse rejects them): non-finite numbers become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def read_samples(run: Run) -> list[dict]:
    """samples.jsonl of a run (the newest :data:`MAX_SAMPLES`); a torn last line (a run still writing) is skipped."""
    path = run.paths.samples
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out[-MAX_SAMPLES:]


def charts(runs: list[Run]) -> list[dict]:
    """One chart per metric any run logged: {"section", "panel", "key", "kind"}, training metrics in
    :data:`PANELS` order (then "other"), the eval metrics last."""
    order = {panel: i for i, (panel, _, _) in enumerate(PANELS)}
    train = sorted({k for run in runs for k in numeric_keys(run.train, NOT_PLOTTED)})
    out = []
    for key in train:
        panel, section = panel_of(key)
        out.append({"section": section, "panel": panel, "key": key, "kind": "train"})
    sections = list(dict.fromkeys(s for _, s, _ in PANELS)) + ["other"]
    out.sort(key=lambda c: (sections.index(c["section"]), order.get(c["panel"], len(order)), c["key"]))
    evals = sorted({k for run in runs for k in numeric_keys(run.evals, EVAL_NOT_PLOTTED)})
    out += [{"section": "eval", "panel": "eval", "key": k, "kind": "eval"} for k in evals]
    return out


def page_data(runs: list[Run], *, smooth: float) -> dict:
    return _clean(
        {
            "title": " vs ".join(r.name for r in runs) if len(runs) > 1 else f"{runs[0].name} ({runs[0].method})",
            "smooth": smooth,
            "charts": charts(runs),
            "runs": [
                {
                    "name": r.name,
                    "method": r.method,
                    "summary": summarize(r),
                    "train": r.train,
                    "evals": r.evals,
                    "samples": read_samples(r),
                }
                for r in runs
            ],
        }
    )


def render(runs: list[Run], *, smooth: float = 0.6, refresh_s: int = 0) -> str:
    """The page's text. ``refresh_s`` > 0 makes the browser reload it that often (``--follow``)."""
    data = json.dumps(page_data(runs, smooth=smooth), separators=(",", ":"))
    data = data.replace("<", "\\u003c")  # nothing in the data can close the script element
    title = html.escape(" vs ".join(r.name for r in runs))
    refresh = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s > 0 else ""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; script-src 'unsafe-inline'; "
        f"style-src 'unsafe-inline'; img-src data:\">{refresh}"
        f"<title>rlctl report: {title}</title><style>{(HERE / 'report.css').read_text()}</style></head>\n"
        "<body><header></header><main></main>\n"
        f'<script type="application/json" id="rlctl-data">{data}</script>\n'
        f"<script>{(HERE / 'report.js').read_text()}</script>\n</body></html>\n"
    )


def write_html(runs: list[Run], out: str | Path, *, smooth: float = 0.6, refresh_s: int = 0) -> Path:
    """Write the page to ``out`` atomically (a reader never sees half a file, e.g. while following a run)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(render(runs, smooth=smooth, refresh_s=refresh_s))
    tmp.replace(out)
    return out
