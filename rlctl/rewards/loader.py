"""Finding a reward function from a spec: a built-in name, ``path/to/file.py:fn`` or ``module:fn``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from rlctl.errors import UserError, did_you_mean
from rlctl.rewards.builtin import BUILTINS

__all__ = ["DEFAULT_FUNCTION", "RewardFn", "default_for_data_source", "get_reward"]

RewardFn = Callable[..., Any]
"""``fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``."""

DEFAULT_FUNCTION = "compute_score"  # verl's default name for a custom reward function

_FORMS = "a built-in name, path/to/file.py[:function] or package.module:function"

_BY_DATA_SOURCE = {
    "openai/gsm8k": "gsm8k",
    "gsm8k": "gsm8k",
    "lighteval/math": "math",
    "digitallearninggmbh/math-lighteval": "math",
    "huggingfaceh4/math-500": "math",
    "math": "math",
}


def default_for_data_source(data_source: str) -> str | None:
    """The built-in reward name for a known ``data_source`` (case-insensitive), else None."""
    return _BY_DATA_SOURCE.get(str(data_source).strip().lower())


def get_reward(spec: str) -> RewardFn:
    """The reward function named by ``spec``.

    ``spec`` is a built-in name (see :data:`rlctl.rewards.builtin.BUILTINS`), a Python file
    ``path/to/file.py:function`` (the function defaults to ``compute_score``), or an importable
    ``package.module:function``. Raises :class:`UserError` naming what is missing.
    """
    spec = spec.strip()
    if spec in BUILTINS:
        return BUILTINS[spec]
    target, _, name = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if _looks_like_file(target):
        return _function(_load_file(Path(target).expanduser()), name or DEFAULT_FUNCTION, target)
    if name and target:
        return _function(_import_module(target), name, target)
    raise UserError(
        f"unknown reward {spec!r}{did_you_mean(spec, BUILTINS)}; give {_FORMS} (built-ins: {', '.join(BUILTINS)})"
    )


def _looks_like_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _load_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise UserError(f"reward file {path} not found; check the path in the reward spec")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
    module_spec = importlib.util.spec_from_file_location(f"rlctl_user_reward_{digest}", resolved)
    if module_spec is None or module_spec.loader is None:
        raise UserError(f"cannot load {path} as Python; a reward file must be a .py file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise UserError(f"reward file {path} failed to load: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise UserError(f"reward module {name!r} not found; install it or add its folder to PYTHONPATH") from exc
        raise UserError(f"reward module {name!r} failed to import: {exc}") from exc
    except Exception as exc:
        raise UserError(f"reward module {name!r} failed to import: {type(exc).__name__}: {exc}") from exc


def _function(module: ModuleType, name: str, where: str) -> RewardFn:
    fn = getattr(module, name, None)
    if fn is None:
        functions = [n for n, f in vars(module).items() if inspect.isfunction(f) and not n.startswith("_")]
        hint = did_you_mean(name, functions)
        raise UserError(f"{where} has no function {name!r}{hint}; check the reward spec")
    if not callable(fn):
        raise UserError(f"{where}:{name} is a {type(fn).__name__}, not a function; check the reward spec")
    return fn
