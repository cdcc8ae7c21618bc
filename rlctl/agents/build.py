"""Building each tool source from its spec (see :func:`rlctl.agents.tools.load_agent_spec`)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from rlctl.agents.loading import (
    env_tool_names,
    function_schema,
    load_class,
    load_functions,
    method_schema,
    read_yaml_list,
    split_spec,
)
from rlctl.agents.sources import EnvClass, Functions, Interactions, VerlTools
from rlctl.agents.verl_compat import install_shim
from rlctl.errors import UserError, one_line

__all__ = ["env_class", "functions", "interactions", "verl_tools"]


def functions(spec: str) -> Functions:
    fns, path = load_functions(spec)
    return Functions(fns, [function_schema(fn, path) for fn in fns.values()], path, split_spec(spec)[1])


def env_class(spec: str) -> EnvClass:
    path, name = split_spec(spec)
    if not name:
        raise UserError(f"--env {spec!r} names no class; give FILE.py:ClassName")
    cls = load_class(spec, "environment")
    names = env_tool_names(cls)
    return EnvClass(cls, names, [method_schema(cls, n, path) for n in names], path, spec)


def _search_dirs(path: str) -> tuple[Path, ...]:
    return (Path(path).expanduser().resolve().parent, Path.cwd())


def _schema_dict(tool: Any, given: dict | None, where: str) -> dict:
    if isinstance(given, dict):
        schema = given
    else:
        obj = getattr(tool, "tool_schema", None) or tool.get_openai_tool_schema()
        schema = obj.model_dump(exclude_unset=True, exclude_none=True) if hasattr(obj, "model_dump") else obj
    name = (schema or {}).get("function", {}).get("name") if isinstance(schema, dict) else None
    if not isinstance(name, str) or not name:
        raise UserError(f"{where}: a tool has no tool_schema.function.name; give tool_schema in the YAML")
    return schema


def verl_tools(path: str, lifecycle: str = "call") -> VerlTools:
    """verl's tool config: ``tools: [{class_name, config: {type: native, ...}, tool_schema}]``."""
    install_shim()
    schema_type = importlib.import_module("verl.tools.schemas").OpenAIFunctionToolSchema
    tools, schemas = [], []
    for entry in read_yaml_list(path, "tools", "tool config"):
        config = dict(entry.get("config") or {})
        kind = str(config.get("type", "native")).lower()
        if kind != "native":
            raise UserError(f"{path}: tool {entry['class_name']} has config.type={kind}; rlctl runs native tools only")
        cls = load_class(entry["class_name"], "verl tool", _search_dirs(path))
        given = entry.get("tool_schema")
        try:
            tool = cls(config=config, tool_schema=schema_type.model_validate(given) if given else None)
        except Exception as exc:
            raise UserError(
                f"{path}: {entry['class_name']}(...) failed: {type(exc).__name__}: {one_line(exc)}"
            ) from exc
        tools.append(tool)
        schemas.append(_schema_dict(tool, given, path))
    return VerlTools(tools, schemas, path, lifecycle)


def interactions(spec: str) -> Interactions:
    """verl's interaction config (``interaction: [{name, class_name, config}]``) or ``FILE.py:Class``."""
    install_shim()
    if Path(spec).suffix.lower() in (".yaml", ".yml"):
        entries = read_yaml_list(spec, "interaction", "interaction config")
        dirs = _search_dirs(spec)
    else:
        entries, dirs = [{"class_name": spec, "config": {}}], ()
    objects: dict[str, Any] = {}
    for entry in entries:
        cls = load_class(entry["class_name"], "interaction", dirs)
        config = dict(entry.get("config") or {})
        name = entry.get("name") or config.get("name") or cls.__name__
        config.setdefault("name", name)
        try:
            objects[name] = cls(config)
        except Exception as exc:
            raise UserError(
                f"{spec}: {entry['class_name']}(config) failed: {type(exc).__name__}: {one_line(exc)}"
            ) from exc
    return Interactions(objects, spec)
