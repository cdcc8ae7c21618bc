"""Headless Chromium (Debian's `chromium`, driven by Playwright) for the HTML report's tests: the page is
opened from its file, every request it makes is recorded, and its console errors fail the test."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    assert path, "chromium is not installed: `apt-get install chromium` (.ci/run installs it)"
    return path


@contextlib.contextmanager
def open_page(html: Path, *, width: int = 1300, height: int = 900):
    """Yield (page, requests, errors): every URL the page asked for, and its script errors."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            requests: list[str] = []
            errors: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(html.resolve().as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=20_000)
            yield page, requests, errors
        finally:
            browser.close()


def metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl read by hand: (training records, the last of each step; eval records)."""
    train, evals = {}, {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            (evals if r.get("kind") == "eval" else train)[r["step"]] = r
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def check_curves(page, run: Path) -> int:
    """Every numeric metric of metrics.jsonl has its chart, and each chart's line has exactly as many
    points as the file has finite values of it. Returns the number of charts checked."""
    train, evals = metrics(run)
    skip = {"step", "total_steps", "time", "epoch", "reward/mean"}  # the x axis, bookkeeping, duplicates
    keys = {k for r in train for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    checked = 0
    for kind, records, wanted in [("train", train, keys - skip), ("eval", evals, {"val/reward/mean"})]:
        for key in sorted(wanted):
            if not any(key in r for r in records):
                continue
            finite = sum(1 for r in records if isinstance(r.get(key), (int, float)) and r[key] == r[key])
            sel = f'.chart[data-metric="{key}"][data-kind="{kind}"] [data-points]'
            got = page.eval_on_selector_all(sel, "els => els.map(e => +e.getAttribute('data-points'))")
            assert got == [finite], (kind, key, got, finite)
            checked += 1
    n_charts = page.eval_on_selector_all(".chart[data-kind='train']", "els => els.length")
    assert n_charts == len(keys - skip), (n_charts, sorted(keys - skip))
    return checked


def non_blank(png: Path) -> float:
    """The share of the screenshot's pixels that differ from its most common colour."""
    from PIL import Image

    im = Image.open(png).convert("RGB")
    counts = im.getcolors(im.width * im.height)
    return 1.0 - max(c for c, _ in counts) / (im.width * im.height)
