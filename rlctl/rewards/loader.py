"""Finding a reward function from a spec: a built-in name, ``path/to/file.py:fn`` or ``module:fn``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from rlctl.errors import UserError, did_you_mean, name_hint
from rlctl.rewards.builtin import BUILTINS
from rlctl.usercode import import_user_file, import_user_module, is_file_spec

__all__ = ["DEFAULT_FUNCTION", "RewardFn", "default_for_data_source", "get_reward"]

RewardFn = Callable[..., Any]
"""``fn(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``."""

DEFAULT_FUNCTION = "compute_score"  # verl's default name for a custom reward function

_MODULE_FIX = "install it or add its folder to PYTHONPATH"
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
    if is_file_spec(target):
        return _function(_load_file(Path(target).expanduser()), name or DEFAULT_FUNCTION, target)
    if name and target:
        from rlctl.agents.verl_compat import install_shim

        install_shim()
        return _function(import_user_module(target, "reward", _MODULE_FIX), name, target)
    raise UserError(
        f"unknown reward {spec!r}{did_you_mean(spec, BUILTINS)}; give {_FORMS} (built-ins: {', '.join(BUILTINS)})"
    )


def _load_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise UserError(f"reward file {path} not found; check the path in the reward spec")
    from rlctl.agents.verl_compat import install_shim

    # a verl reward file imports verl.utils.reward_score helpers: they resolve with or without verl
    return import_user_file(path, "reward", before=install_shim)


def _function(module: ModuleType, name: str, where: str) -> RewardFn:
    fn = getattr(module, name, None)
    if fn is None:
        functions = [n for n, f in vars(module).items() if inspect.isfunction(f) and not n.startswith("_")]
        raise UserError(f"{where} has no function {name!r}{name_hint(name, functions)}; check the reward spec")
    if not callable(fn):
        raise UserError(f"{where}:{name} is a {type(fn).__name__}, not a function; check the reward spec")
    return fn
