"""docs/estimate.md's comparison tables are rlctl.plan.compare's output, never typed by hand."""

from __future__ import annotations

from pathlib import Path

from rlctl.plan.compare import embedded, markdown


def test_docs_tables_are_the_generated_ones():
    doc = Path(__file__).resolve().parents[2] / "docs" / "estimate.md"
    assert embedded(doc.read_text()) == markdown().strip(), "run: python -m rlctl.plan.compare --write docs/estimate.md"
