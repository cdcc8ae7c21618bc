"""Where tools come from, each attaching its per-trajectory state to an :class:`Episode`.

* :class:`Functions`: plain functions (stateless; sync or async);
* :class:`EnvClass`: TRL's environment convention, one instance per trajectory;
* :class:`VerlTools`: verl ``BaseTool`` objects, one instance id per trajectory
  (create -> execute... -> calc_reward -> release), kwargs from the row's ``extra_info.tools_kwargs``;
* :class:`Interactions`: verl ``BaseInteraction`` objects, chosen by ``extra_info.interaction_kwargs.name``.
"""

from __future__ import annotations

import functools
import inspect
import json
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlctl.agents.calls import Tool, tool_text
from rlctl.agents.guard import guarded
from rlctl.errors import UserError

if TYPE_CHECKING:
    from rlctl.agents.episode import Episode

__all__ = ["EnvClass", "Functions", "Interactions", "VerlTools", "extra_info"]


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
    """Plain tool functions (sync or async), loaded in each trajectory's worker process and called there."""

    reward_names: tuple[str, ...] = ()

    def __init__(self, functions: dict[str, Callable], schemas: list[dict], where: str, chosen: str = ""):
        self.functions, self.schemas, self.where, self.chosen = functions, schemas, where, chosen
        self.names = list(functions)

    def attach(self, episode: Episode, row: dict) -> None:
        host = episode.sync_host()
        loaded = host.add(("functions", self.where if not self.chosen else f"{self.where}:{self.chosen}"))
        if not loaded.ok:
            why = loaded.why(episode.timeout_s)
            raise UserError(f"tools file {self.where} failed to load in its worker process: {why}")
        style = episode.style_for("trl")
        for name, fn in self.functions.items():
            episode.add_tool(
                name, Tool(None, None, _signature(fn), style, functools.partial(host.call, name, style=style))
            )

    def describe(self) -> str:
        return f"{len(self.names)} tool function(s) from {self.where} ({', '.join(self.names)})"


class EnvClass:
    """An environment class: ``Class()`` per trajectory, ``reset(**row)``, public methods as tools,
    ``get_reward()`` as the reward component ``env``, ``close()`` when the trajectory ends."""

    def __init__(self, cls: type, names: list[str], schemas: list[dict], where: str, spec: str = ""):
        self.cls, self.names, self.schemas, self.where, self.spec = cls, names, schemas, where, spec
        self.has_reward = callable(getattr(cls, "get_reward", None))
        self.reward_names = ("env",) if self.has_reward else ()

    def attach(self, episode: Episode, row: dict) -> None:
        """The environment lives in the trajectory's worker process (rlctl.agents.sync_host): constructed,
        reset, its methods and get_reward called there, on that process's main thread, as TRL does."""
        host = episode.sync_host()
        reset = host.add(("env", self.spec, row))
        if not reset.ok:
            why = reset.why(episode.timeout_s)
            raise UserError(f"environment {self.cls.__name__}() / reset() failed: {why}; fix {self.where}")
        value = reset.value
        if value is not None and not isinstance(value, str):
            raise UserError(
                f"environment {self.cls.__name__}.reset() returned {type(value).__name__}; return a str or None"
            )
        episode.prompt_suffix = value or None
        style = episode.style_for("trl")
        for name in self.names:
            sig = _signature(getattr(self.cls, name))
            bound = not isinstance(inspect.getattr_static(self.cls, name), (staticmethod, classmethod))
            if sig is not None and bound:  # without self
                sig = sig.replace(parameters=list(sig.parameters.values())[1:])
            episode.add_tool(name, Tool(None, None, sig, style, functools.partial(host.call, name, style=style)))
        if self.has_reward:
            episode.add_reward("env", host.reward)

    def describe(self) -> str:
        return f"environment {self.cls.__name__} from {self.where} ({', '.join(self.names) or 'no tools'})"


class VerlTools:
    """verl tool objects (one per YAML entry). ``lifecycle`` ``call`` (verl's tool agent loop): each call is
    ``create(create_kwargs=...)``, ``execute(instance_id, parameters, agent_data=...)``, ``release``, and
    ``calc_reward`` is never called; ``trajectory`` (verl's older SGLang rollout): one instance per trajectory,
    ``create(instance_id, **create_kwargs)``, ``execute(..., **execute_kwargs)``, ``calc_reward`` (a reward
    component named by the tool) and ``release`` when it ends. Kwargs from the row's ``extra_info.tools_kwargs``."""

    reward_names = ("tool",)

    def __init__(self, tools: list[Any], schemas: list[dict], where: str, lifecycle: str = "call"):
        self.tools, self.schemas, self.where, self.lifecycle = tools, schemas, where, lifecycle
        self.names = [s["function"]["name"] for s in schemas]

    def attach(self, episode: Episode, row: dict) -> None:
        kwargs_by_tool = extra_info(row).get("tools_kwargs") or {}
        agent_data = AgentData(episode, f"rlctl-{uuid.uuid4().hex}", kwargs_by_tool, row)
        for name, tool in zip(self.names, self.tools):
            kw = kwargs_by_tool.get(name) or {}
            style = episode.style_for("verl")
            if self.lifecycle == "call":
                run = functools.partial(_verl_call, tool, dict(kw.get("create_kwargs") or {}), agent_data)
                episode.add_tool(name, Tool(run, _verl_step, style=style))
            else:
                self._attach_instance(episode, name, tool, kw, style)

    def _attach_instance(self, episode: Episode, name: str, tool: Any, kw: dict, style: str) -> None:
        create_kw = dict(kw.get("create_kwargs") or {})
        instance = f"rlctl-{uuid.uuid4().hex}"
        created = guarded(lambda t=tool, i=instance, c=create_kw: t.create(i, **c), episode.timeout_s)
        if not created.ok:
            why = created.why(episode.timeout_s)
            raise UserError(f"verl tool {name}: create() failed: {why}; fix its class in {self.where}")
        instance = _instance_id(created.value) or instance
        execute_kw = dict(kw.get("execute_kwargs") or {})
        episode.add_tool(
            name, Tool(lambda args, t=tool, i=instance, e=execute_kw: t.execute(i, args, **e), _verl_step, style=style)
        )
        reward_kw = dict(kw.get("calc_reward_kwargs") or {})
        episode.add_reward(name, lambda t=tool, i=instance, r=reward_kw: t.calc_reward(i, **r))
        release_kw = dict(kw.get("release_kwargs") or {})
        episode.add_closer(lambda t=tool, i=instance, r=release_kw: t.release(i, **r))

    def describe(self) -> str:
        return f"{len(self.names)} verl tool(s) from {self.where} ({', '.join(self.names)})"


def _instance_id(value: Any) -> str | None:
    """What ``create`` returned: verl 0.5+ ``(instance_id, ToolResponse)``, older verl the id."""
    if isinstance(value, tuple) and value:
        value = value[0]
    return value if isinstance(value, str) and value else None


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _verl_call(tool: Any, create_kwargs: dict, agent_data: Any, arguments: dict) -> Any:
    """One call as verl's tool agent loop makes it: a fresh instance, execute with ``agent_data``, release."""
    instance = _instance_id(await _maybe(tool.create(create_kwargs=create_kwargs)))
    try:
        params = inspect.signature(tool.execute).parameters.values()
        takes = any(p.kind is p.VAR_KEYWORD or p.name == "agent_data" for p in params)
        return await _maybe(tool.execute(instance, arguments, **({"agent_data": agent_data} if takes else {})))
    finally:
        if instance:
            await _maybe(tool.release(instance))


class AgentData:
    """What verl's tool agent loop hands ``execute`` as ``agent_data``: the trajectory's conversation so far
    (``messages``), ``request_id``, ``tools_kwargs``, ``interaction_kwargs``, its turn counts and scores, and
    ``extra_fields`` for a tool's own session data (images and videos: none, rlctl's agent runs are text)."""

    def __init__(self, episode: Episode, request_id: str, tools_kwargs: dict, row: dict):
        self._episode, self.request_id, self.tools_kwargs = episode, request_id, tools_kwargs
        self.interaction_kwargs = dict(extra_info(row).get("interaction_kwargs") or {})
        self.image_data, self.video_data = None, None
        self.metrics: dict = {}
        self.extra_fields: dict = {}
        self.tool_rewards: list[float] = []
        self.interaction = None

    @property
    def messages(self) -> list[dict]:
        return self._episode.messages

    @property
    def turn_scores(self) -> list[float]:
        return self._episode.turn_scores

    @property
    def assistant_turns(self) -> int:
        return sum(m.get("role") == "assistant" for m in self._episode.messages)

    @property
    def user_turns(self) -> int:
        return sum(m.get("role") in ("user", "tool") for m in self._episode.messages) - 1


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
        started = guarded(lambda: obj.start_interaction(instance, **kwargs), episode.timeout_s)
        if not started.ok:
            why = started.why(episode.timeout_s)
            raise UserError(f"interaction {name}: start_interaction() failed: {why}; fix {self.where}")
        instance = started.value if isinstance(started.value, str) and started.value else instance
        episode.set_interaction(lambda messages: obj.generate_response(instance, messages, **kwargs))
        episode.add_reward("interaction", lambda: episode.turn_scores[-1] if episode.turn_scores else 0.0)
        finalize = obj.finalize_interaction
        takes_args = any(p.kind != p.VAR_KEYWORD for p in inspect.signature(finalize).parameters.values())
        episode.add_closer(lambda: finalize(instance) if takes_args else finalize())

    def describe(self) -> str:
        return f"interaction {', '.join(self.objects)} from {self.where}"
