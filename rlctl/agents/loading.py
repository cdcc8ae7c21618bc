"""Loading what ``--tools``, ``--env`` and ``--interaction`` name, torch-free, with one-line errors.

* a Python file of tool functions: ``FILE.py`` (every public function defined in it) or
  ``FILE.py:name1,name2``; each schema comes from the type hints and the Google-style docstring
  (``transformers.utils.get_json_schema``, what TRL and chat templates use);
* verl's tool config YAML (``tools:`` with ``class_name``, ``config``, ``tool_schema``);
* an environment class ``FILE.py:Class`` (TRL's environment_factory convention): its public methods
  are the tools, ``reset`` and ``get_reward`` are not;
* verl's interaction config YAML (``interaction:`` with ``name``, ``class_name``, ``config``) or an
  interaction class ``FILE.py:Class``.
"""

from __future__ import annotations

import functools
import inspect
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from rlctl.agents.verl_compat import BUNDLED_VERSION, install_shim
from rlctl.errors import UserError, name_hint, one_line
from rlctl.usercode import import_user_file, import_user_module

__all__ = [
    "NOT_TOOLS",
    "env_tool_names",
    "function_schema",
    "load_class",
    "load_file",
    "load_functions",
    "method_schema",
    "read_yaml_list",
    "split_spec",
]

NOT_TOOLS = frozenset({"reset", "get_reward", "close"})
"""Public methods of an environment class that are its life cycle, not tools."""


def split_spec(spec: str) -> tuple[str, str]:
    """``"path/file.py:a,b"`` -> ``("path/file.py", "a,b")``; a Windows drive letter is not a separator."""
    target, sep, names = spec.strip().rpartition(":")
    if not sep or not target or "/" in names or "\\" in names:
        return spec.strip(), ""
    return target, names


def load_file(path_text: str, what: str) -> ModuleType:
    """Import a user's Python file (once per process); a missing file or an import error is one line."""
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UserError(f"{what} file {path} not found; check the path")
    if path.suffix != ".py":
        raise UserError(f"{what} file {path} is not a .py file")
    # a verl tool file imports verl.tools.base_tool: install_shim lets it run unchanged without verl
    return import_user_file(path, what, before=install_shim)


def function_schema(fn: Callable, where: str) -> dict:
    """The OpenAI function schema of ``fn`` from its type hints and Google-style docstring."""
    from transformers.utils import chat_template_utils as ctu

    # get_json_schema imports torch (only to map torch.Tensor hints to "audio"); keep loading torch-free
    # unless torch is already there (a tool hinted with torch.Tensor imported it itself).
    saved = ctu.is_torch_available
    if "torch" not in sys.modules:
        ctu.is_torch_available = lambda: False
    try:
        return ctu.get_json_schema(fn)
    except Exception as exc:  # DocstringParsingException, TypeHintParsingException, ...
        raise UserError(
            f"tool {fn.__name__!r} in {where}: {one_line(exc)} (a tool needs a type hint and a line under "
            "'Args:' in its Google-style docstring for every argument)"
        ) from exc
    finally:
        ctu.is_torch_available = saved


def method_schema(cls: type, name: str, where: str) -> dict:
    """The schema of method ``name`` of ``cls`` as its instances' bound method would have it."""
    raw = inspect.getattr_static(cls, name)
    fn = getattr(cls, name)
    if isinstance(raw, (staticmethod, classmethod)):
        return function_schema(fn, where)
    try:
        hints = typing.get_type_hints(fn)
    except Exception as exc:
        raise UserError(f"tool {name!r} in {where}: its type hints do not resolve ({one_line(exc)})") from exc
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1:]  # without self

    @functools.wraps(fn)
    def bound(*args, **kwargs):  # never called: only its signature and docstring are read
        raise NotImplementedError

    bound.__signature__ = sig.replace(parameters=params)
    bound.__annotations__ = {k: v for k, v in hints.items() if k in {p.name for p in params} or k == "return"}
    del bound.__wrapped__
    return function_schema(bound, where)


def load_functions(spec: str) -> tuple[dict[str, Callable], str]:
    """The tool functions ``FILE.py[:a,b]`` names, and the file's path."""
    path, names = split_spec(spec)
    module = load_file(path, "tools")
    public = {
        n: f
        for n, f in vars(module).items()
        if not n.startswith("_") and inspect.isfunction(f) and f.__module__ == module.__name__
    }
    if not names:
        if not public:
            raise UserError(f"tools file {path} defines no public function; define one (or name them: FILE.py:a,b)")
        return public, path
    chosen = {}
    for name in (n.strip() for n in names.split(",") if n.strip()):
        fn = getattr(module, name, None)
        if not callable(fn):
            raise UserError(f"tools file {path} has no function {name!r}{name_hint(name, public)}")
        chosen[name] = fn
    return chosen, path


def env_tool_names(cls: type) -> list[str]:
    """The public methods of an environment class, minus reset/get_reward/close."""
    names = []
    for name in dir(cls):
        if name.startswith("_") or name in NOT_TOOLS or hasattr(object, name):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, property) or not callable(getattr(cls, name)):
            continue
        names.append(name)
    return names


def load_class(spec: str, what: str, base_dirs: tuple[Path, ...] = ()) -> type:
    """A class from ``FILE.py:Class`` or a dotted ``package.module.Class`` (verl's class_name form)."""
    path, name = split_spec(spec)
    if path.endswith(".py") or "/" in path:
        if not name:
            raise UserError(f"{what} {spec!r} names no class; give FILE.py:ClassName")
        module = load_file(path, what)
        where = path
    else:
        module_name, _, name = spec.strip().rpartition(".")
        if not module_name:
            raise UserError(f"{what} class {spec!r} is not a dotted path; give package.module.Class or FILE.py:Class")
        module = _import_module(module_name, what, base_dirs)
        where = module_name
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        classes = [n for n, v in vars(module).items() if isinstance(v, type) and not n.startswith("_")]
        raise UserError(f"{what}: {where} has no class {name!r}{name_hint(name, classes)}")
    return cls


def _import_module(name: str, what: str, base_dirs: tuple[Path, ...]) -> ModuleType:
    install_shim()
    added = [str(d) for d in base_dirs if str(d) not in sys.path]
    sys.path[:0] = added  # verl resolves class_name on PYTHONPATH; the YAML's folder and the cwd also work
    fix = "add its folder to PYTHONPATH"
    if name == "verl" or name.startswith("verl."):  # verl's bundled tools / interactions: gone from verl 0.8 on
        fix = (
            f"it is one of verl's bundled classes, which only {BUNDLED_VERSION} has: pip install '{BUNDLED_VERSION}', "
            "or copy its file next to your YAML and name it there (its verl imports run unchanged under rlctl)"
        )
    return import_user_module(name, what, fix)


def read_yaml_list(path_text: str, key: str, what: str) -> list[dict]:
    """The ``key:`` list of a verl config YAML (``${...}`` interpolation resolved, as verl's OmegaConf does)."""
    from omegaconf import OmegaConf

    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UserError(f"{what} file {path} not found; check the path")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:
        raise UserError(f"{what} file {path} is not valid YAML: {one_line(exc)}") from exc
    entries = data.get(key) if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{what} file {path} has no '{key}:' list (verl's format: {key}: [{{class_name: ..., ...}}])")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise UserError(f"{what} file {path}: entry {i} of '{key}:' has no class_name")
        if not isinstance(entry.get("config") or {}, dict):
            raise UserError(f"{what} file {path}: entry {i} of '{key}:' has a config that is not a mapping")
    return entries


def call_with_row(fn: Callable, row: dict) -> Any:
    """``fn(**row)``, passing only the keys ``fn`` accepts unless it takes ``**kwargs``."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn(**row)
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return fn(**{k: v for k, v in row.items() if k in names})
