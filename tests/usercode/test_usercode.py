"""rlctl.usercode: a user's module or file imported once, each failure one line naming the file and line."""

from __future__ import annotations

import sys

import pytest

from rlctl.errors import UserError
from rlctl.usercode import import_user_file, import_user_module, is_file_spec


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_missing_module_and_a_module_that_fails_are_told_apart(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "uc_needs_dep.py").write_text("x = 1\nimport uc_no_such_dependency\n")
    (tmp_path / "uc_raises.py").write_text("def f():\n    return 1 / 0\n\nf()\n")
    assert _error(import_user_module, "uc_no_such_module", "reward", "install it") == (
        "reward module 'uc_no_such_module' not found; install it"
    )
    assert _error(import_user_module, "uc_needs_dep", "reward", "install it") == (
        "reward module 'uc_needs_dep' failed to import: ModuleNotFoundError: No module named "
        "'uc_no_such_dependency' (uc_needs_dep.py line 2)"
    )
    assert _error(import_user_module, "uc_raises", "plugin", "-") == (
        "plugin module 'uc_raises' failed to import: ZeroDivisionError: division by zero (uc_raises.py line 2)"
    )
    assert import_user_module("json", "reward", "-") is sys.modules["json"]


def test_a_file_is_imported_once_and_a_failing_one_leaves_nothing_behind(tmp_path):
    counter = tmp_path / "counted.py"
    runs = tmp_path / "runs.txt"
    counter.write_text(f"with open({str(runs)!r}, 'a') as f:\n    f.write('x')\n")
    first = import_user_file(counter, "tools")
    try:
        assert import_user_file(counter, "reward") is first and runs.read_text() == "x"
        assert first.__name__.startswith("rlctl_user_counted_") and sys.modules[first.__name__] is first
    finally:
        sys.modules.pop(first.__name__, None)
    bad = tmp_path / "bad.py"
    bad.write_text("a = 1\nb = undefined_name\n")
    assert _error(import_user_file, bad, "plugin", prefix="rlctl_plugin") == (
        f"plugin file {bad} failed to import: NameError: name 'undefined_name' is not defined (bad.py line 2); "
        "fix the file (or install what it imports)"
    )
    assert not [m for m in sys.modules if m.startswith("rlctl_plugin_bad_")]


@pytest.mark.parametrize(
    ("spec", "is_file"), [("x.py", True), ("dir/x", True), ("c:\\x\\y", True), ("pkg.mod", False), ("mod", False)]
)
def test_is_file_spec(spec, is_file):
    assert is_file_spec(spec) is is_file
