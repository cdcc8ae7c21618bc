"""rlctl's estimate beside published measured peak-memory figures (benchmarks/estimate_vs_published.py):
the done-criteria of issue 13, and docs/benchmarks.md showing what the script prints."""

from __future__ import annotations

import importlib.util
import statistics
import sys

from tests.support.cli import REPO


def _bench():
    spec = importlib.util.spec_from_file_location("estimate_vs_published", REPO / "benchmarks/estimate_vs_published.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_published_figures_within_the_error_bounds_and_verdicts_right():
    bench = _bench()
    rows = bench.rows()
    counted = [r for r in rows if r["figure"].counted]
    assert len(counted) >= 15
    assert all(r["figure"].source.startswith("https://") for r in rows)
    errors = [abs(r["error"]) for r in counted]
    assert statistics.median(errors) <= 0.10
    assert max(errors) <= 0.25
    # every published run that trained on its GPU is estimated to fit there (counted or not)
    assert all(r["verdict_ok"] for r in rows if r["verdict_ok"] is not None)


def test_benchmarks_doc_shows_the_generated_table():
    bench = _bench()
    text = (REPO / "docs/benchmarks.md").read_text()
    block = text.split(bench.BEGIN, 1)[1].split(bench.END, 1)[0]
    assert block.strip() == bench.render().strip(), (
        "run: python benchmarks/estimate_vs_published.py --write docs/benchmarks.md"
    )
