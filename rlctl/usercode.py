"""A user's Python code (a reward, a tool, a plugin) imported by module name or from a file, once per
process; any failure is one :class:`~rlctl.errors.UserError` naming what failed, the error and its line.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from rlctl.errors import UserError, one_line

__all__ = ["error_text", "import_user_file", "import_user_module", "is_file_spec"]

FILE_FIX = "fix the file (or install what it imports)"


def is_file_spec(spec: str) -> bool:
    """Does ``spec`` name a file (``x.py``, ``dir/x``), not an importable module name?"""
    return spec.endswith(".py") or "/" in spec or "\\" in spec


def import_user_module(name: str, what: str, fix: str) -> ModuleType:
    """``importlib.import_module(name)``; ``what`` names it in the error (``reward``, ``plugin``...).

    The module itself missing: ``{what} module 'name' not found; {fix}``. Anything else (a package it
    imports missing, an error in its code): ``{what} module 'name' failed to import: Type: message (file line N)``.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(f"{e.name}.")):
            raise UserError(f"{what} module {name!r} not found; {fix}") from None
        raise UserError(f"{what} module {name!r} failed to import: {error_text(e)}") from None
    except Exception as e:  # noqa: BLE001 - the user's code: any error is one line
        raise UserError(f"{what} module {name!r} failed to import: {error_text(e)}") from None


def import_user_file(
    path: Path, what: str, before: Callable[[], object] | None = None, prefix: str = "rlctl_user"
) -> ModuleType:
    """Import the ``.py`` file ``path`` (which exists) as a module of its own, once per process.

    The module is registered in ``sys.modules`` (dataclasses and pickling look it up by name) as
    ``{prefix}_{stem}_{digest of the absolute path}``; ``before`` runs just before the file's code. Any error the file
    raises: ``{what} file PATH failed to import: Type: message (file line N); fix the file ...``.
    """
    resolved = path.expanduser().resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    name = f"{prefix}_{resolved.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise UserError(f"cannot load {path} as Python; a {what} file must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        if before is not None:
            before()
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - the user's code: any error is one line
        del sys.modules[name]
        if isinstance(e, KeyboardInterrupt):
            raise
        raise UserError(f"{what} file {path} failed to import: {error_text(e, resolved)}; {FILE_FIX}") from None
    return module


def error_text(e: BaseException, path: Path | None = None) -> str:
    """``NameError: name 'x' is not defined (my_loss.py line 7)``: the error and the line of ``path`` (else
    the innermost frame) that raised it; a UserError (e.g. a name registered twice) as it is."""
    if isinstance(e, UserError):
        return str(e)
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} ({Path(e.filename or '?').name} line {e.lineno})"
    message = one_line(e)
    text = f"{type(e).__name__}: {message}" if message else type(e).__name__
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<frozen")]
    mine = [f for f in frames if path is None or Path(f.filename) == path] or frames
    if mine:
        text += f" ({Path(mine[-1].filename).name} line {mine[-1].lineno})"
    return text
