"""Plugins: the user's Python modules that extend rlctl's registries (a policy loss, an advantage
estimator: :mod:`rlctl.algos.registry`), named by ``plugins`` in the config or ``--plugin``.

Each is a ``.py`` file or an importable module name. :func:`load_plugins` imports each once per
process, before the config is checked, so a name it registers is a valid ``algo.policy_loss``; it runs
in the CLI and again on every rank (the resolved config keeps each file's absolute path). A plugin
that fails to import is one line naming the file, the error and its line. See docs/plugins.md.
"""

from __future__ import annotations

from pathlib import Path

from rlctl.errors import UserError
from rlctl.usercode import import_user_file, import_user_module, is_file_spec

HOW = "a plugin is a .py file or an importable module name, e.g. --plugin my_loss.py"


def load_plugins(specs: list[str]) -> list[str]:
    """Import every plugin (once per process); the specs with each file made absolute."""
    out = []
    for spec in specs:
        spec = spec.strip()
        if not spec:
            continue
        if is_file_spec(spec):
            path = Path(spec).expanduser().resolve()
            if not path.is_file():
                raise UserError(f"plugin file not found: {spec} ({HOW})")
            import_user_file(path, "plugin", prefix="rlctl_plugin")
            out.append(str(path))
        else:
            import_user_module(spec, "plugin", HOW)
            out.append(spec)
    return out
