"""verl's tool and interaction base classes, for users who do not have verl installed.

A verl tool class imports ``BaseTool`` from ``verl.tools.base_tool`` and its schema types from
``verl.tools.schemas``; a verl interaction imports ``BaseInteraction`` from ``verl.interactions.base``.
Such a file runs under rlctl either with one import changed (``from rlctl.agents.verl_compat import
BaseTool, ToolResponse``) or unchanged: when verl itself is not importable, :func:`install_shim`
registers these classes under verl's module names (only those modules, nothing else of verl).

The classes follow verl 0.9's: ``BaseTool.__init__(config, tool_schema)`` and the async
create/execute/calc_reward/release life cycle; ``BaseInteraction.__init__(config)`` and the async
start_interaction/generate_response/calculate_score/finalize_interaction. The schema types are
small attribute-access records with pydantic's ``model_validate`` / ``model_dump`` (verl uses
pydantic; rlctl does not depend on it).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any
from uuid import uuid4

__all__ = [
    "BaseInteraction",
    "BaseTool",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionPropertySchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ToolResponse",
    "install_shim",
    "rollout_trace_op",
]


class _Record:
    """A dict with attribute access, nested records for nested dicts; ``model_dump`` gives the dict."""

    _fields: dict[str, type[_Record]] = {}

    def __init__(self, **data: Any):
        for key, value in data.items():
            sub = self._fields.get(key)
            if sub is not None and isinstance(value, dict):
                value = sub.model_validate(value)
            elif key == "properties" and isinstance(value, dict):
                value = {k: OpenAIFunctionPropertySchema.model_validate(v) for k, v in value.items()}
            setattr(self, key, value)

    @classmethod
    def model_validate(cls, data: Any) -> _Record:
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise TypeError(f"{cls.__name__} expects a dict, got {type(data).__name__}")
        return cls(**data)

    def model_dump(self, exclude_unset: bool = False, exclude_none: bool = False, **_: Any) -> dict:
        def dump(value: Any) -> Any:
            if isinstance(value, _Record):
                return value.model_dump(exclude_none=exclude_none)
            if isinstance(value, dict):
                return {k: dump(v) for k, v in value.items() if not (exclude_none and v is None)}
            if isinstance(value, list):
                return [dump(v) for v in value]
            return value

        return {k: dump(v) for k, v in vars(self).items() if not (exclude_none and v is None)}

    def __getattr__(self, name: str) -> Any:  # optional fields read as None, as pydantic defaults do
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_dump()})"


class OpenAIFunctionPropertySchema(_Record):
    """One parameter: ``type``, ``description``, ``enum``."""


class OpenAIFunctionParametersSchema(_Record):
    """``type`` (object), ``properties``, ``required``."""


class OpenAIFunctionSchema(_Record):
    """``name``, ``description``, ``parameters``."""

    _fields = {"parameters": OpenAIFunctionParametersSchema}


class OpenAIFunctionToolSchema(_Record):
    """``{"type": "function", "function": {...}}``."""

    _fields = {"function": OpenAIFunctionSchema}


class ToolResponse(_Record):
    """What ``execute`` returns first: ``text`` (and ``image`` / ``video``, which rlctl ignores)."""

    def __init__(self, text: str | None = None, image: list | None = None, video: list | None = None, **extra: Any):
        super().__init__(text=text, image=image, video=video, **extra)


def rollout_trace_op(fn):
    """verl's tracing decorator: a no-op here."""
    return fn


class BaseTool:
    """verl's ``BaseTool``: one object per tool, one instance id per trajectory."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | dict | None):
        self.config = config
        schema = tool_schema or self.get_openai_tool_schema()
        if schema is None:
            raise ValueError(f"{type(self).__name__} has no tool schema: give tool_schema in the tool YAML")
        self.tool_schema = OpenAIFunctionToolSchema.model_validate(schema)
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


class BaseInteraction:
    """verl's ``BaseInteraction``: a simulated user answering each assistant turn."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs) -> str:
        return instance_id or str(uuid4())

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs
    ) -> tuple[bool, str, float, dict[str, Any]]:
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, *args, **kwargs) -> float:
        return 0.0

    async def finalize_interaction(self, *args, **kwargs) -> None:
        return None


_SHIM = {
    "verl": {},
    "verl.tools": {},
    "verl.tools.base_tool": {"BaseTool": BaseTool, "rollout_trace_op": rollout_trace_op},
    "verl.tools.schemas": {
        "OpenAIFunctionPropertySchema": OpenAIFunctionPropertySchema,
        "OpenAIFunctionParametersSchema": OpenAIFunctionParametersSchema,
        "OpenAIFunctionSchema": OpenAIFunctionSchema,
        "OpenAIFunctionToolSchema": OpenAIFunctionToolSchema,
        "ToolResponse": ToolResponse,
    },
    "verl.interactions": {},
    "verl.interactions.base": {"BaseInteraction": BaseInteraction},
    "verl.utils": {},
    "verl.utils.rollout_trace": {"rollout_trace_op": rollout_trace_op},
}


def install_shim() -> bool:
    """Register the classes above under verl's module names unless verl is importable; True if it did."""
    if "verl" in sys.modules and not getattr(sys.modules["verl"], "__rlctl_shim__", False):
        return False
    if "verl" not in sys.modules and importlib.util.find_spec("verl") is not None:
        return False
    for name, attrs in _SHIM.items():
        if name in sys.modules:
            continue
        module = types.ModuleType(name, f"rlctl's stand-in for {name} (verl is not installed)")
        module.__dict__.update(attrs)
        module.__path__ = []  # a package, so submodule imports resolve through sys.modules
        module.__rlctl_shim__ = True
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    return True
