"""Where tools come from, each attaching its per-trajectory state to an :class:`Episode`.

* :class:`Functions`: plain functions (stateless; sync or async);
* :class:`EnvClass`: TRL's environment convention, one instance per trajectory;
* :class:`VerlTools`: verl ``BaseTool`` objects, one instance id per trajectory
  (create -> execute... -> calc_reward -> release), kwargs from the row's ``extra_info.tools_kwargs``;
* :class:`Interactions`: verl ``BaseInteraction`` objects, chosen by ``extra_info.interaction_kwargs.name``.
"""

from __future__ import annotations

import inspect
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlctl.agents.guard import guarded
from rlctl.agents.loading import call_with_row
from rlctl.errors import UserError

if TYPE_CHECKING:
    from rlctl.agents.tools import Episode

__all__ = ["EnvClass", "Functions", "Interactions", "Tool", "VerlTools", "extra_info", "tool_text"]


@dataclass(frozen=True)
class Tool:
    """One tool of one trajectory: ``run(arguments)`` (may return an awaitable), ``interpret(value) ->
    (text, step reward)``, and the signature that checks the arguments (None: the tool checks them)."""

    run: Callable[[dict], Any]
    interpret: Callable[[Any], tuple[str, float]]
    signature: inspect.Signature | None = None


def tool_text(value: Any) -> str:
    """What the model sees of a tool's return value: text as is, verl's ToolResponse by its text,
    anything else as JSON (or its str)."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    text = getattr(value, "text", None)
    if isinstance(text, str) or (text is None and type(value).__name__ == "ToolResponse"):
        return text or ""
    if isinstance(value, dict) and set(value) <= {"text", "image", "video"} and "text" in value:
        return str(value["text"] or "")
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


def _plain(value: Any) -> tuple[str, float]:
    return tool_text(value), 0.0


def _verl_step(value: Any) -> tuple[str, float]:
    """verl's execute result: ``(ToolResponse | str, step_reward, metrics)`` (or without metrics)."""
    if isinstance(value, tuple) and len(value) in (2, 3):
        return tool_text(value[0]), float(value[1] or 0.0)
    return tool_text(value), 0.0


def extra_info(row: dict) -> dict:
    info = row.get("extra_info")
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except ValueError:
            return {}
    return info if isinstance(info, dict) else {}


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


class Functions:
    """Plain tool functions, shared by every trajectory."""

    reward_names: tuple[str, ...] = ()

    def __init__(self, functions: dict[str, Callable], schemas: list[dict], where: str):
        self.functions, self.schemas, self.where = functions, schemas, where
        self.names = list(functions)

    def attach(self, episode: Episode, row: dict) -> None:
        for name, fn in self.functions.items():
            episode._tools[name] = Tool(lambda args, fn=fn: fn(**args), _plain, _signature(fn))

    def describe(self) -> str:
        return f"{len(self.names)} tool function(s) from {self.where} ({', '.join(self.names)})"


class EnvClass:
    """An environment class: ``Class()`` per trajectory, ``reset(**row)``, public methods as tools,
    ``get_reward()`` as the reward component ``env``, ``close()`` when the trajectory ends."""

    def __init__(self, cls: type, names: list[str], schemas: list[dict], where: str):
        self.cls, self.names, self.schemas, self.where = cls, names, schemas, where
        self.has_reward = callable(getattr(cls, "get_reward", None))
        self.reward_names = ("env",) if self.has_reward else ()

    def attach(self, episode: Episode, row: dict) -> None:
        def start():
            env = self.cls()
            reset = getattr(env, "reset", None)
            return env, (call_with_row(reset, row) if callable(reset) else None)

        status, value = guarded(start, episode.timeout_s)
        if status != "ok":
            why = value if status == "error" else f"took longer than {episode.timeout_s:g} s"
            raise UserError(f"environment {self.cls.__name__}() / reset() failed: {why}; fix {self.where}")
        env, suffix = value
        if suffix is not None and not isinstance(suffix, str):
            raise UserError(
                f"environment {self.cls.__name__}.reset() returned {type(suffix).__name__}; return a str or None"
            )
        episode.prompt_suffix = suffix or None
        for name in self.names:
            method = getattr(env, name)
            episode._tools[name] = Tool(lambda args, m=method: m(**args), _plain, _signature(method))
        if self.has_reward:
            episode._rewards.append(("env", env.get_reward))
        if callable(getattr(env, "close", None)):
            episode._closers.append(env.close)

    def describe(self) -> str:
        return f"environment {self.cls.__name__} from {self.where} ({', '.join(self.names) or 'no tools'})"


class VerlTools:
    """verl tool objects (one per YAML entry), an instance id per trajectory."""

    reward_names = ("tool",)

    def __init__(self, tools: list[Any], schemas: list[dict], where: str):
        self.tools, self.schemas, self.where = tools, schemas, where
        self.names = [s["function"]["name"] for s in schemas]

    def attach(self, episode: Episode, row: dict) -> None:
        kwargs_by_tool = extra_info(row).get("tools_kwargs") or {}
        for name, tool in zip(self.names, self.tools):
            kw = kwargs_by_tool.get(name) or {}
            create_kw = dict(kw.get("create_kwargs") or {})
            instance = f"rlctl-{uuid.uuid4().hex}"
            status, value = guarded(lambda t=tool, i=instance, c=create_kw: t.create(i, **c), episode.timeout_s)
            if status != "ok":
                why = value if status == "error" else f"took longer than {episode.timeout_s:g} s"
                raise UserError(f"verl tool {name}: create() failed: {why}; fix its class in {self.where}")
            if isinstance(value, tuple) and value:  # verl 0.5+: (instance_id, ToolResponse); older: the id
                value = value[0]
            instance = value if isinstance(value, str) and value else instance
            execute_kw = dict(kw.get("execute_kwargs") or {})
            episode._tools[name] = Tool(
                lambda args, t=tool, i=instance, e=execute_kw: t.execute(i, args, **e), _verl_step
            )
            reward_kw = dict(kw.get("calc_reward_kwargs") or {})
            episode._rewards.append((name, lambda t=tool, i=instance, r=reward_kw: t.calc_reward(i, **r)))
            release_kw = dict(kw.get("release_kwargs") or {})
            episode._closers.append(lambda t=tool, i=instance, r=release_kw: t.release(i, **r))

    def describe(self) -> str:
        return f"{len(self.names)} verl tool(s) from {self.where} ({', '.join(self.names)})"


class Interactions:
    """verl interactions by name; a trajectory uses ``extra_info.interaction_kwargs.name`` (else the first)."""

    schemas: list[dict] = []
    names: list[str] = []
    reward_names = ("interaction",)

    def __init__(self, objects: dict[str, Any], where: str):
        self.objects, self.where = objects, where

    def attach(self, episode: Episode, row: dict) -> None:
        kwargs = dict(extra_info(row).get("interaction_kwargs") or {})
        name = kwargs.get("name") or next(iter(self.objects))
        obj = self.objects.get(name)
        if obj is None:
            raise UserError(f"interaction {name!r} (extra_info.interaction_kwargs.name) is not in {self.where}")
        instance = f"rlctl-{uuid.uuid4().hex}"
        status, value = guarded(lambda: obj.start_interaction(instance, **kwargs), episode.timeout_s)
        if status != "ok":
            why = value if status == "error" else f"took longer than {episode.timeout_s:g} s"
            raise UserError(f"interaction {name}: start_interaction() failed: {why}; fix {self.where}")
        instance = value if isinstance(value, str) and value else instance
        episode._interaction = lambda messages: obj.generate_response(instance, messages, **kwargs)
        episode._rewards.append(("interaction", lambda: episode.turn_scores[-1] if episode.turn_scores else 0.0))
        finalize = obj.finalize_interaction
        takes_args = any(p.kind != p.VAR_KEYWORD for p in inspect.signature(finalize).parameters.values())
        episode._closers.append(lambda: finalize(instance) if takes_args else finalize())

    def describe(self) -> str:
        return f"interaction {', '.join(self.objects)} from {self.where}"
