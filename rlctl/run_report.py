"""`rlctl report RUN_DIR`: what a run did, in a few lines and one picture.

:func:`load_run` reads a run directory (metrics.jsonl, summary.json, config.yaml, the checkpoints);
:func:`summarize` condenses it (steps, time, tokens/s, first / last / best reward or loss, the eval
results, the checkpoints, the Hugging Face export); :func:`curves` picks the series to plot, one panel
each: reward and its components (``reward/<name>``), loss, KL, entropy, response length, tokens/s and
the eval metrics; :func:`plot` draws them with matplotlib (the ``plot`` extra) into RUN/report.png,
several runs overlaid with ``--compare``, and writes the plotted numbers next to it (report.json: for
each panel and line, the x and y it drew; a NaN is written as null).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.errors import UserError
from rlctl.metrics import read_metrics
from rlctl.runtime.layout import RunPaths, list_checkpoints

PLOT_HINT = "pip install 'rlctl[plot]'"
# reward/<key> entries that describe the reward's bookkeeping, not a component of it
REWARD_BOOKKEEPING = {"reward/mean", "reward/std", "reward/failed", "reward/nonfinite", "reward/errors"}


@dataclass
class Run:
    name: str
    paths: RunPaths
    train: list[dict]  # one record per step (the last one written wins, as after a resume)
    evals: list[dict]
    summary: dict | None
    method: str
    checkpoints: list[Path] = field(default_factory=list)
    config: dict = field(default_factory=dict)  # config.yaml as written ({} when absent)


def load_run(run_dir: str | Path) -> Run:
    root = Path(run_dir).expanduser()
    paths = RunPaths(root)
    if not root.is_dir():
        raise UserError(f"no run directory {root}; pass the --output-dir of an rlctl sft/grpo/ppo run")
    records = read_metrics(paths.metrics)
    if not records:
        raise UserError(f"{paths.metrics} holds no metrics yet; is {root} an rlctl run directory?")
    by_step: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for r in records:
        if "step" in r:
            (evals if r.get("kind") == "eval" else by_step)[int(r["step"])] = r
    summary = json.loads(paths.summary.read_text()) if paths.summary.is_file() else None
    method, config = "sft", {}
    if paths.config.is_file():
        import yaml

        config = yaml.safe_load(paths.config.read_text()) or {}
        method = config.get("method", method)
    elif any("reward" in r for r in by_step.values()):
        method = "grpo"
    return Run(
        name=root.name,
        paths=paths,
        train=[by_step[s] for s in sorted(by_step)],
        evals=[evals[s] for s in sorted(evals)],
        summary=summary,
        method=method,
        checkpoints=list_checkpoints(paths.checkpoints) if paths.checkpoints.is_dir() else [],
        config=config,
    )


def _finite(values: list) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def summarize(run: Run) -> dict:
    """The run in numbers: what `rlctl report` prints (and --json gives)."""
    t = run.train
    main = "reward" if any("reward" in r for r in t) else "loss"
    values = [r.get(main) for r in t]
    finite = _finite(values)
    steps_time = _finite([r.get("time/step") for r in t])
    stamps = _finite([r.get("time") for r in t])
    wall = stamps[-1] - stamps[0] + (steps_time[0] if steps_time else 0.0) if len(stamps) > 1 else sum(steps_time)
    tps = _finite([r.get("tokens_per_s") for r in t])
    best_fn = max if main == "reward" else min
    best = best_fn(((v, r["step"]) for v, r in zip(values, t) if v is not None and math.isfinite(v)), default=None)
    out = {
        "run": str(run.paths.root),
        "method": run.method,
        "status": (run.summary or {}).get("status", "running or killed (no summary.json)"),
        "steps": t[-1]["step"] if t else 0,
        "total_steps": (t[-1].get("total_steps") if t else None),
        "time_s": wall,
        "tokens_per_s": sum(tps) / len(tps) if tps else None,
        "metric": main,
        "first": finite[0] if finite else None,
        "last": finite[-1] if finite else None,
        "best": best[0] if best else None,
        "best_step": best[1] if best else None,
        "nonfinite_steps": [r["step"] for r, v in zip(t, values) if v is not None and not math.isfinite(v)],
        "evals": [{k: v for k, v in e.items() if k not in ("kind", "time")} for e in run.evals],
        "checkpoints": [str(c) for c in run.checkpoints],
        "hf": (run.summary or {}).get("hf"),
        "async": _async(run),
    }
    return out


def _async(run: Run) -> dict | None:
    """Whether streaming would pay for this job, from its own record (rlctl.plan.run_async): the
    ``rollout.mode`` decision as data; None for a run without a rollout (sft, dpo, ...)."""
    from rlctl.plan.run_async import run_decision

    if run.method != "grpo":
        return None
    d = run_decision(run.train, run.config)
    return d.to_dict() if d else None


# The panels of a report, in order: (panel, section, which metric keys it draws). The PNG draws one panel
# each; the HTML report draws one chart per metric, under its section's heading.
# The failure counters (flat at zero in a healthy run) come last but "other"; accuracy sits with the reward.
FAILURE_COUNTERS = {
    "reward/failed",
    "reward/nonfinite",
    "reward/errors",
    "tool/errors",
    "tool/timeouts",
    "tool/malformed",
}
PANELS: list[tuple[str, str, Callable[[str], bool]]] = [
    ("reward", "reward", lambda k: k in ("reward", "acc") or (k.startswith("reward/") and k not in REWARD_BOOKKEEPING)),
    ("reward spread", "reward", lambda k: k == "reward/std"),
    ("loss", "loss and KL", lambda k: k in ("loss", "pg/loss", "critic/value_loss")),
    ("KL", "loss and KL", lambda k: k in ("kl", "kl_loss", "pg/approx_kl")),
    ("entropy", "entropy", lambda k: k == "entropy"),
    ("grad norm", "optimizer", lambda k: k.endswith("grad_norm")),
    ("lr", "optimizer", lambda k: k == "lr" or k.endswith("/lr")),
    ("clip fraction", "optimizer", lambda k: k.endswith("clip_frac")),
    ("response length", "lengths", lambda k: k.startswith("response_len/")),
    ("truncated", "lengths", lambda k: k.startswith("response/")),
    ("agent turns", "agent and tools", lambda k: k.startswith(("turns/", "tool/")) and k not in FAILURE_COUNTERS),
    ("tokens/s", "throughput and timings", lambda k: k in ("tokens_per_s", "tokens")),
    ("time", "throughput and timings", lambda k: k.startswith("time/")),
    ("memory", "memory", lambda k: k.startswith(("mem/", "memory/"))),
    ("rollout", "rollout", lambda k: k.startswith(("rollout/", "dynamic/", "offpolicy/"))),
    ("failures", "failures", lambda k: k in FAILURE_COUNTERS),
]
NOT_PLOTTED = {"step", "total_steps", "time", "epoch", "reward/mean"}  # the x axis, bookkeeping, duplicates
EVAL_NOT_PLOTTED = {"step", "time", "time/eval"}


def panel_of(key: str) -> tuple[str, str]:
    """(panel, section) of a training metric; "other" for a key no panel claims."""
    for panel, section, wants in PANELS:
        if wants(key):
            return panel, section
    return "other", "other"


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key`` over ``records`` (NaN kept: a gap in the line)."""
    pts = [(int(r["step"]), float(r[key])) for r in records if _is_number(r.get(key))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def numeric_keys(records: list[dict], skip: set[str]) -> list[str]:
    return sorted({k for r in records for k, v in r.items() if _is_number(v)} - skip)


def curves(run: Run) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """panel -> line label -> (steps, values) of every series a run logged, panels in :data:`PANELS` order,
    then "other", then "eval" (every number of the eval records)."""
    by_panel: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for key in numeric_keys(run.train, NOT_PLOTTED):
        x, y = series(run.train, key)
        if x:
            by_panel.setdefault(panel_of(key)[0], {})[key] = (x, y)
    order = [p for p, _, _ in PANELS] + ["other"]
    panels = {p: by_panel[p] for p in order if p in by_panel}
    evals = {k: series(run.evals, k) for k in numeric_keys(run.evals, EVAL_NOT_PLOTTED)}
    if any(v[0] for v in evals.values()):
        panels["eval"] = {k: v for k, v in evals.items() if v[0]}
    return panels


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start; NaN/inf are skipped
    (the smoothed line carries the last finite value)."""
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        if math.isfinite(v):
            acc, norm = acc * weight + (1 - weight) * v, norm * weight + (1 - weight)
        out.append(acc / norm if norm else math.nan)
    return out


def _json_number(v: float) -> float | None:
    return v if math.isfinite(v) else None


def plot(runs: list[Run], out: str | Path, *, sidecar: str | Path | None = None, smooth: float = 0.6):
    """Draw every panel any of ``runs`` has into ``out`` (PNG): training curves smoothed (EMA ``smooth``)
    over the raw values drawn faint, eval as points, one colour per run when several are overlaid, integer
    step ticks. Writes the plotted numbers to ``sidecar`` (JSON). Returns the (closed) matplotlib figure."""
    try:
        import matplotlib
    except ImportError:
        raise UserError(f"rlctl report draws its PNG with matplotlib: {PLOT_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    per_run = [(run, curves(run)) for run in runs]
    names = []
    for _, panels in per_run:
        names += [p for p in panels if p not in names]
    if not names:
        raise UserError(f"{runs[0].paths.metrics} has no numeric metrics to plot")
    cols = 2 if len(names) > 1 else 1
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 3.2 * rows), squeeze=False)
    drawn: dict[str, dict[str, dict]] = {}
    for i, panel in enumerate(names):
        ax = axes[i // cols][i % cols]
        for j, (run, panels) in enumerate(per_run):
            for k, (label, (x, y)) in enumerate(panels.get(panel, {}).items()):
                full = f"{run.name}: {label}" if len(runs) > 1 else label
                color, style = (f"C{j % 10}", LINE_STYLES[k % 4]) if len(runs) > 1 else (f"C{k % 10}", "-")
                drawn.setdefault(panel, {})[full] = _draw(ax, x, y, full, color, style, panel, smooth)
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        labels = [ln.get_label() for ln in ax.get_lines() if not ln.get_label().startswith("_")]
        if len(labels) > 1 or (labels and labels[0] != panel):
            ax.legend(fontsize=7)
    for i in range(len(names), rows * cols):
        axes[i // cols][i % cols].set_visible(False)
    fig.suptitle(" vs ".join(run.name for run in runs) if len(runs) > 1 else f"{runs[0].name} ({runs[0].method})")
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    if sidecar is not None:
        doc = {"runs": [str(run.paths.root) for run in runs], "png": str(out), "smooth": smooth, "panels": drawn}
        Path(sidecar).write_text(json.dumps(doc, indent=1) + "\n")
    return fig


LINE_STYLES = ["-", "--", ":", "-."]


def _draw(ax, x: list[int], y: list[float], label: str, color: str, style: str, panel: str, smooth: float) -> dict:
    """One series: eval and single points as markers; otherwise the raw values faint (label ``_raw:...``,
    kept out of the legend) under their EMA. Returns the series' sidecar entry."""
    entry = {"x": x, "y": [_json_number(v) for v in y]}
    if panel == "eval" or len(x) == 1 or not smooth:
        ax.plot(x, y, style, color=color, marker="o" if panel == "eval" or len(x) == 1 else None, label=label)
        return entry
    smoothed = ema(y, smooth)
    ax.plot(x, y, style, color=color, alpha=0.25, linewidth=0.8, label=f"_raw:{label}")
    ax.plot(x, smoothed, style, color=color, label=label)
    return {**entry, "smoothed": [_json_number(v) for v in smoothed]}


def render_summary(console, s: dict) -> None:
    """The summary as a rich table (names and keys from the run's files shown as text, inert: never markup
    nor terminal controls)."""
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from rlctl.terminal import inert

    def num(v, fmt: str = ".4g") -> str:
        return "-" if v is None else format(v, fmt)

    table = Table(title=escape(inert(f"{s['run']} ({s['method']})")), show_header=False)
    table.add_column(style="bold")
    table.add_column()
    total = f" of {s['total_steps']}" if s.get("total_steps") else ""
    table.add_row("status", str(s["status"]))
    table.add_row("steps", f"{s['steps']}{total} in {num(s['time_s'], '.1f')} s")
    table.add_row("tokens/s", num(s["tokens_per_s"], ",.0f"))
    m = s["metric"]
    best = f"{num(s['best'])} at step {s['best_step']}" if s["best"] is not None else "-"
    table.add_row(Text(inert(m)), f"first {num(s['first'])}, last {num(s['last'])}, best {best}")
    if s["nonfinite_steps"]:
        table.add_row(f"{m} not finite", f"at steps {', '.join(map(str, s['nonfinite_steps'][:10]))}")
    for e in s["evals"][-3:]:
        vals = ", ".join(f"{k} {num(v)}" for k, v in e.items() if k != "step" and not k.startswith("time"))
        table.add_row(f"eval at step {e['step']}", Text(inert(vals)))
    if not s["evals"]:
        table.add_row("eval", "none (give --val-data or --val-fraction)")
    table.add_row("checkpoints", ", ".join(Path(c).name for c in s["checkpoints"]) or "none")
    table.add_row("Hugging Face export", s["hf"] or "none")
    if s.get("async"):
        table.add_row("async", Text(async_line(s["async"])))
    console.print(table)


def async_line(d: dict) -> str:
    """The ``rollout.mode`` decision in words: its verdict, the flags that ask for it, its reason."""
    v = d["value"]
    head = f"stream pays: {v['flags']}" if v["mode"] == "stream" else "stream does not pay: keep synchronous"
    return f"{head}. {d['why']}"
