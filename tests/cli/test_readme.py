"""The README's example outputs are the CLI's (issue 24: they had drifted): regenerated in this
process and compared, so a change to the planner or the estimate that alters them fails here."""

from __future__ import annotations

from tests.support.readme import BLOCK, README, regenerate


def test_the_readme_examples_are_what_the_cli_prints():
    text = README.read_text()
    assert len(BLOCK.findall(text)) >= 2, "the README lost its generated example blocks"
    assert text == regenerate(text), "the README's examples drifted: run `python -m tests.support.readme`"


def test_presets_show_never_crops_a_line(monkeypatch, capsys):
    """`rlctl presets show` piped or in a file: whole YAML lines (issue 24: cut at 80 columns)."""
    import yaml

    from tests.support.cli import rlctl_in_process

    monkeypatch.setenv("COLUMNS", "80")
    code, text = rlctl_in_process(monkeypatch, capsys, "presets", "show", "tiers")
    assert code == 0, text
    assert max(len(line) for line in text.splitlines()) > 80
    assert isinstance(yaml.safe_load(text), dict)


def test_the_readme_demo_output_says_what_varies_across_machines():
    """Issue 37, item 14: the demo's figures are printed as "the end of its output"; a reader on another
    machine gets figures a point away and must be told so, and why, before the block."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    before_block = readme[: readme.index("held-out accuracy (greedy decoding)")]
    intro = before_block[before_block.rindex("The end of its output") :]
    assert "another machine" in intro and "float kernels" in intro and "docs/demo.md#what-varies" in intro, intro
    demo = (Path(__file__).resolve().parents[2] / "docs" / "demo.md").read_text()
    assert "### What varies" in demo
