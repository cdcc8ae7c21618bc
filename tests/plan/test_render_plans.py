"""tests/support/scripts/render_plans.py (the grid of dry-run plans a refactoring holds byte-identical) on a
slice of its grid: the same code renders the same bytes twice, each case is a plan or a one-line refusal, and
a changed byte is named."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "scripts" / "render_plans.py"


def _script(monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # what the script sets, restored after the test
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # it runs the CLI in this process
    spec = importlib.util.spec_from_file_location("render_plans", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_slice_of_the_grid_renders_the_same_bytes_twice(monkeypatch, tmp_path):
    rp = _script(monkeypatch)
    cases = rp.grid()
    assert len(cases) >= 1400 and len({name for name, _ in cases}) == len(cases)  # every case its own file
    a, b = tmp_path / "a", tmp_path / "b"
    assert rp.render(a, every=150) == rp.render(b, every=150) == len(cases[::150])
    assert rp.compare(a, b) == [] and rp.digest(a) == rp.digest(b)
    outcomes = set()
    for path in sorted(a.glob("*.txt")):
        text = path.read_text()
        plan, refused = "[exit 0]\nplan: rlctl " in text, "[exit 2]\nerror: " in text
        assert plan != refused, path.name  # a plan, or a one-line refusal
        outcomes.add(plan)
        assert "--- json [exit" in text, path.name
    assert outcomes == {True, False}  # the slice holds both

    first = sorted(b.glob("*.txt"))[0]
    first.write_bytes(first.read_bytes() + b" ")
    assert rp.compare(a, b) == [first.name] and rp.digest(a) != rp.digest(b)
