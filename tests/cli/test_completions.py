"""Shell completion as a user meets it (issue 37, item 11): the generated bash script, run by bash.

Options that take a file (--tools, --env, --interaction, --chat-template, ...) complete file names; --preset
offers only what --preset accepts (every name offered loads as a run preset; tiers.yaml, the planner's
rules, is not offered)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support.cli import REPO

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def complete(words: list[str], cwd) -> list[str]:
    """COMPREPLY of the generated script for ``rlctl WORDS`` (the last word being completed)."""
    script = REPO / "completions" / "rlctl.bash"
    quoted = " ".join(f"'{w}'" for w in ["rlctl", *words])
    cmd = f"source '{script}'; COMP_WORDS=({quoted}); COMP_CWORD={len(words)}; _rlctl; "
    cmd += "printf '%s\\n' \"${COMPREPLY[@]}\""
    out = subprocess.run(["bash", "-c", cmd], cwd=cwd, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if line]


@pytest.mark.parametrize("flag", ["--tools", "--env", "--interaction", "--chat-template", "--val-data"])
def test_file_options_complete_file_names(tmp_path, flag):
    (tmp_path / "tools_calc.py").write_text("")
    (tmp_path / "template.jinja").write_text("")
    assert complete(["grpo", flag, "to"], tmp_path) == ["tools_calc.py"]
    assert complete(["grpo", flag, "te"], tmp_path) == ["template.jinja"]


def test_preset_offers_only_what_preset_accepts(tmp_path):
    from rlctl.presets import load_preset, method_layers

    offered = complete(["grpo", "--preset", ""], tmp_path)
    assert offered and "tiers" not in offered
    for name in offered:
        method = load_preset(name).get("method") or name
        method_layers(method, name)  # raises for a preset --preset refuses
