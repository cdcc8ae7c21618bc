"""The HTML report in headless Chromium: every curve has as many points as metrics.jsonl has values, a
step's samples are the ones samples.jsonl holds for it, filters, smoothing and zoom act, the page asks
for nothing over the network, and it renders (a non-blank screenshot)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

from tests.support.browser import check_curves, non_blank, open_page
from tests.support.cli import run_cli

FIXTURE = Path(__file__).parent / "fixtures" / "grpo_tiny"


def _run_with_samples(tmp_path: Path) -> Path:
    run = Path(shutil.copytree(FIXTURE, tmp_path / "grpo_tiny"))
    rng = random.Random(0)
    rows = []
    for step in (1, 4, 8):
        for p in range(3):
            for k in range(4):
                reward = round(rng.random(), 3)
                rows.append(
                    {
                        "step": step,
                        "prompt": f"What is {p} + {step}? </script><script>window.pwned = 1</script>",
                        "response": f"{p + step + k}",
                        "reward": reward,
                        "advantage": reward - 0.5,
                        "ground_truth": str(p + step),
                        "response_len": 3,
                        "truncated": k == 3,
                    }
                )
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _shown_rewards(page) -> list[float]:
    return page.eval_on_selector_all(".sample", "els => els.map(e => +e.getAttribute('data-reward'))")


def test_html_report_in_chromium(tmp_path):
    run = _run_with_samples(tmp_path)
    r = run_cli("report", str(run), "--no-plot")
    assert r.returncode == 0, r.stderr
    html = run / "report.html"
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    with open_page(html) as (page, requests, errors):
        assert check_curves(page, run) >= 20
        # the last step with samples is shown first; choosing step 4 shows exactly step 4's samples
        assert sorted(_shown_rewards(page)) == sorted(s["reward"] for s in samples if s["step"] == 8)
        page.select_option("#step-select", "4")
        step4 = [s for s in samples if s["step"] == 4]
        shown = _shown_rewards(page)
        assert sorted(shown) == sorted(s["reward"] for s in step4)
        per_prompt = [shown[i : i + 4] for i in range(0, len(shown), 4)]
        assert all(g == sorted(g, reverse=True) for g in per_prompt)  # sorted by reward, high first
        page.fill("#min-reward", "0.5")
        assert sorted(_shown_rewards(page)) == sorted(s["reward"] for s in step4 if s["reward"] >= 0.5)
        page.fill("#min-reward", "")
        page.select_option("#finish-select", "length")
        assert len(_shown_rewards(page)) == sum(s["truncated"] for s in step4)
        assert page.evaluate("window.pwned") is None  # the prompt's markup is text, not code
        assert "</script><script>" in page.text_content("#sample-list")

        # smoothing changes the smoothed line, never the raw one; a drag zooms every chart to its steps
        raw = '.chart[data-metric="reward"] path.raw'
        smooth = '.chart[data-metric="reward"] path.smoothed'
        before = (page.get_attribute(raw, "d"), page.get_attribute(smooth, "d"))
        page.fill("#smooth", "0.9")
        page.dispatch_event("#smooth", "input")
        assert page.get_attribute(raw, "d") == before[0] and page.get_attribute(smooth, "d") != before[1]
        box = page.locator('.chart[data-metric="reward"] svg').bounding_box()
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + 60)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] * 0.98, box["y"] + 60, steps=4)
        page.mouse.up()
        ticks = page.eval_on_selector_all(
            '.chart[data-metric="entropy"] .axis text', "els => els.map(e => e.textContent)"
        )
        assert "1" not in ticks and "8" in ticks, ticks  # zoomed to the second half, in every chart

        shot = tmp_path / "shot.png"
        page.screenshot(path=str(shot), full_page=True)
        assert non_blank(shot) > 0.05
    assert errors == []
    assert requests == [html.resolve().as_uri()], requests  # the page itself, nothing else


def test_compare_writes_its_own_files_in_distinct_colours(tmp_path):
    run = _run_with_samples(tmp_path)
    other = Path(shutil.copytree(FIXTURE, tmp_path / "other"))
    r = run_cli("report", str(run), str(other), "--no-plot")
    assert r.returncode == 0, r.stderr
    page_file = run / "compare-other.html"
    assert page_file.is_file() and not (run / "report.html").exists()
    with open_page(page_file) as (page, requests, errors):
        colours = page.eval_on_selector_all(
            '.chart[data-metric="reward"] path.raw',
            "els => els.map(e => [e.getAttribute('data-run'), e.getAttribute('stroke')])",
        )
        assert [c[0] for c in colours] == ["grpo_tiny", "other"] and colours[0][1] != colours[1][1]
    assert errors == [] and len(requests) == 1


def test_follow_rewrites_until_the_run_ends(tmp_path):
    """--follow: the page reloads itself while the run has no summary.json; once it has, the report is
    written a last time without the reload and the command ends."""
    import subprocess
    import sys
    import time

    from tests.support.cli import REPO

    run = _run_with_samples(tmp_path)
    summary = (run / "summary.json").read_text()
    (run / "summary.json").unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(lines[:3]))
    cmd = [sys.executable, "-m", "rlctl", "report", str(run), "--follow", "--interval", "1", "--no-plot"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        page = run / "report.html"
        deadline = time.time() + 60
        while not (page.is_file() and '"step":3' in page.read_text()) and time.time() < deadline:
            time.sleep(0.2)
        assert '<meta http-equiv="refresh" content="1">' in page.read_text()
        (run / "metrics.jsonl").write_text("".join(lines))  # the run goes on ...
        (run / "summary.json").write_text(summary)  # ... and ends
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    text = page.read_text()
    assert 'http-equiv="refresh"' not in text and '"step":8' in text
    assert "step 3: " in out
