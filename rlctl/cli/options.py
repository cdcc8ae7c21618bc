"""Commands built from the table of flags (:mod:`rlctl.cli.flags`), and their values turned into config options.

:func:`command` makes the typer command of `rlctl sft|grpo|ppo` or `rlctl estimate memory`: one
parameter per flag the command takes, typed as its config key, with the method's default in its help.
:func:`to_options` maps the values a user gave to ``{config key: value}``, the options layer of
:func:`rlctl.job.resolve_job`. No torch import here: --help must stay fast.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from rlctl.cli.flags import FIRST_RUN, FLAGS, Flag

# shown instead of the raw default where the raw value means "decided elsewhere"
SHOWN = {
    "train.micro_batch_size": "from the plan",
    "train.max_steps": "0: the epochs",
    "checkpoint.save_every": "-1: auto",
    "lora.alpha": "2 x rank",
    "train.max_tokens_per_micro_batch": "0: micro batch size x max length",
}


def flags_of(name: str) -> list[Flag]:
    return [f for f in FLAGS if name in f.on]


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def key_type(key: str) -> Any:
    """The type of a config key (``train.lr`` -> float), None stripped; a Literal is its values' type."""
    from rlctl.config import RunConfig

    tp: Any = RunConfig
    for part in key.split("."):
        tp = _hints(tp)[part]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]
    if typing.get_origin(tp) is typing.Literal:
        tp = type(typing.get_args(tp)[0])
    return tp


def option_type(flag: Flag) -> Any:
    if flag.type is not None:
        return flag.type
    if flag.switch:
        return bool | None
    return key_type(flag.key) | None


def _defaults_shown(method: str | None) -> Callable[[Flag], str]:
    """The help suffix of each flag: the method's default (its preset over the config's defaults)."""
    if method is None:
        return lambda flag: ""
    from rlctl.config import build_config, get_key
    from rlctl.presets import method_layers

    cfg = build_config(method, method_layers(method, None))

    def shown(flag: Flag) -> str:
        if not flag.key or not flag.shown or flag.key.split(".")[0] in ("hardware", "model"):
            return ""
        value = SHOWN.get(flag.key, get_key(cfg, flag.key))
        return "" if value in ("", None, []) else f" (default: {value})"

    return shown


def _parameter(flag: Flag, name: str, suffix: str) -> inspect.Parameter:
    info = typer.Option(
        *flag.names(),
        help=flag.help_for(name) + suffix,
        rich_help_panel=flag.panel_for(name),
        hidden=bool(flag.alias_of) or flag.name not in FIRST_RUN,  # the rest: --help-all (rlctl.cli.help)
        show_default=flag.default not in (None, False),
    )
    return inspect.Parameter(
        flag.name, inspect.Parameter.KEYWORD_ONLY, default=flag.default, annotation=Annotated[option_type(flag), info]
    )


def command(name: str, run: Callable[[dict[str, Any]], None], *, doc: str, defaults_of: str | None) -> Callable:
    """The typer command ``name`` (sft, grpo, ppo or estimate): its flags' values go to ``run`` as one dict.
    ``defaults_of``: the method whose defaults its --help shows (None: none shown). Register it with
    ``cls=rlctl.cli.help.FlagsCommand``: --help shows a first run's options, --help-all every one."""
    from rlctl.cli.help import help_all_option

    shown = _defaults_shown(defaults_of)
    params = [_parameter(f, name, shown(f)) for f in flags_of(name)]
    params.append(
        inspect.Parameter(
            "help_all", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[bool, help_all_option()]
        )
    )

    def cmd(**values: Any) -> None:
        run(values)

    cmd.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    cmd.__annotations__ = {p.name: p.annotation for p in params}
    cmd.__name__ = cmd.__qualname__ = name
    cmd.__doc__ = doc
    return cmd


def _given(values: dict[str, Any], flag: Flag, name: str) -> Any:
    """The flag's value, by its name or an old one (both given, they must agree); None when not given."""
    from rlctl.errors import UserError

    value = values.get(flag.name)
    for old in (f for f in flags_of(name) if f.alias_of == flag.name):
        was = values.get(old.name)
        if was is None:
            continue
        if value is not None and value != was:
            old_name = f"{old.long} is the old name of {flag.long}"
            raise UserError(f"{flag.long} {value} and {old.long} {was} disagree: {old_name}; give one")
        value = was
    return None if value == [] else value


def to_options(values: dict[str, Any], name: str) -> dict[str, object]:
    """The CLI layer of the config: {config key: value} for every flag of command ``name`` given."""
    out: dict[str, object] = {}
    for flag in flags_of(name):
        if not flag.key:
            continue
        value = _given(values, flag, name)
        if value is not None:
            out.update(flag.convert(value) if flag.convert else {flag.key: value})
    return out
