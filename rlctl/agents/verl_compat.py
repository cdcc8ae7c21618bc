"""verl's tool and interaction base classes, for users who do not have verl installed.

A verl tool class imports ``BaseTool`` from ``verl.tools.base_tool`` and its schema types from
``verl.tools.schemas``; a verl interaction imports ``BaseInteraction`` from ``verl.interactions.base``.
Such a file runs under rlctl either with one import changed (``from rlctl.agents.verl_compat import
BaseTool, ToolResponse``) or unchanged: :func:`install_shim` makes verl's module names importable module by
module (:data:`STAND_INS`: the base classes, the schema types, the interaction base, the
``verl.utils.reward_score`` helpers), each from the installed verl when it has that module and from these
stand-ins when it does not (no verl, or a verl 0.8+ without ``verl.interactions``).

The classes follow verl 0.9's: ``BaseTool.__init__(config, tool_schema)`` and the async
create/execute/calc_reward/release life cycle; ``BaseInteraction.__init__(config)`` and the async
start_interaction/generate_response/calculate_score/finalize_interaction. The schema types are
small attribute-access records with pydantic's ``model_validate`` / ``model_dump`` (verl uses
pydantic; rlctl does not depend on it).
"""

from __future__ import annotations

import importlib.abc
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
    "BUNDLED_VERSION",
    "STAND_INS",
    "ToolResponse",
    "install_shim",
    "is_stand_in",
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


def _reward_score(name: str) -> dict[str, Any]:
    import rlctl.rewards.verl_scores as v

    if name == "gsm8k":
        return {"compute_score": v.gsm8k_compute_score, "extract_solution": v.gsm8k_extract_solution}
    if name in ("math_reward", "math"):
        return {
            "compute_score": v.math_compute_score,
            "last_boxed_only_string": v.last_boxed_only_string,
            "remove_boxed": v.remove_boxed,
            "is_equiv": v.is_equiv,
        }
    return {"default_compute_score": v.default_compute_score}


_SCHEMAS = {
    "OpenAIFunctionPropertySchema": OpenAIFunctionPropertySchema,
    "OpenAIFunctionParametersSchema": OpenAIFunctionParametersSchema,
    "OpenAIFunctionSchema": OpenAIFunctionSchema,
    "OpenAIFunctionToolSchema": OpenAIFunctionToolSchema,
    "ToolResponse": ToolResponse,
}
STAND_INS: dict[str, Any] = {
    "verl": dict,
    "verl.tools": dict,
    "verl.tools.base_tool": lambda: {"BaseTool": BaseTool, "rollout_trace_op": rollout_trace_op, **_SCHEMAS},
    "verl.tools.schemas": lambda: dict(_SCHEMAS),
    "verl.interactions": dict,
    "verl.interactions.base": lambda: {"BaseInteraction": BaseInteraction},
    "verl.utils": dict,
    "verl.utils.rollout_trace": lambda: {"rollout_trace_op": rollout_trace_op},
    "verl.utils.reward_score": lambda: _reward_score(""),
    "verl.utils.reward_score.gsm8k": lambda: _reward_score("gsm8k"),
    "verl.utils.reward_score.math_reward": lambda: _reward_score("math_reward"),
    "verl.utils.reward_score.math": lambda: _reward_score("math"),
}
"""The verl modules users' files import, each built on first import: what a module's stand-in holds."""

BUNDLED_VERSION = "verl<=0.7.1"
"""The last verl with its bundled tools and interactions (verl.tools.gsm8k_tool, verl.interactions.*)."""


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on ``sys.meta_path``: asked only for a module no other finder has, so an installed verl's own
    modules win and only what it lacks (or all of them, without verl) comes from :data:`STAND_INS`."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname not in STAND_INS:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__dict__.update(STAND_INS[module.__name__]())
        module.__doc__ = f"rlctl's stand-in for {module.__name__} (rlctl.agents.verl_compat)"
        module.__rlctl_shim__ = True


_FINDER = _StandInFinder()


def install_shim() -> None:
    """Make the modules of :data:`STAND_INS` importable, module by module, whether or not some verl is
    installed: each resolves to verl's own when verl has it, else to rlctl's stand-in. Idempotent."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)


def is_stand_in(module_name: str) -> bool:
    """Whether ``module_name`` was imported as rlctl's stand-in."""
    return bool(getattr(sys.modules.get(module_name), "__rlctl_shim__", False))
