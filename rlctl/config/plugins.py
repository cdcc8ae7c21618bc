"""Plugins: the user's Python modules that extend rlctl's registries (a policy loss, an advantage
estimator: :mod:`rlctl.algos.registry`), named by ``plugins`` in the config or ``--plugin``.

Each is a ``.py`` file or an importable module name. :func:`load_plugins` imports each once per
process, before the config is checked, so a name it registers is a valid ``algo.policy_loss``; it runs
in the CLI and again on every rank (the resolved config keeps each file's absolute path). A plugin
that fails to import is one line naming the file, the error and its line. See docs/plugins.md.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from pathlib import Path

from rlctl.errors import UserError

HOW = "a plugin is a .py file or an importable module name, e.g. --plugin my_loss.py"


def is_file_spec(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or "\\" in spec


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
            _import_file(path)
            out.append(str(path))
        else:
            _import_module(spec)
            out.append(spec)
    return out


def _module_name(path: Path) -> str:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    return f"rlctl_plugin_{path.stem}_{digest}"


def _import_file(path: Path) -> None:
    name = _module_name(path)
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"plugin {path} cannot be imported ({HOW})")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - the user's code: any error is one line
        del sys.modules[name]
        if isinstance(e, KeyboardInterrupt):
            raise
        raise UserError(f"plugin {path}: {_one_line(e, path)}") from None


def _import_module(name: str) -> None:
    if name in sys.modules:
        return
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name == name or name.startswith(f"{e.name}."):
            raise UserError(f"plugin module {name!r} not found ({HOW})") from None
        raise UserError(f"plugin {name}: {_one_line(e, None)}") from None
    except Exception as e:  # noqa: BLE001 - the user's code: any error is one line
        raise UserError(f"plugin {name}: {_one_line(e, None)}") from None


def _one_line(e: BaseException, path: Path | None) -> str:
    """``NameError: name 'x' is not defined (my_loss.py line 7)``; a UserError (e.g. a name registered
    twice) as it is."""
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({Path(e.filename or '?').name} line {e.lineno})"
    text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if path is None or Path(f.filename) == path] or frames
    if mine:
        text += f" ({Path(mine[-1].filename).name} line {mine[-1].lineno})"
    return text
