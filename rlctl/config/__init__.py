"""The typed run configuration, and how it is assembled.

One :class:`RunConfig` describes a whole job (sft, grpo or ppo). It is built from four layers,
each overriding the one before::

    preset (presets/<method>.yaml or --preset NAME)  <  --config FILE.yaml  <  CLI options  <  --set key=value

Every layer is a nested dict with dotted paths such as ``train.lr`` or ``rollout.n``. An unknown key
anywhere fails with a did-you-mean suggestion; a value of the wrong type fails naming the key and
the expected type. Enumerated keys take the values of their Literal (:mod:`rlctl.names`). Fields left at
None (``X | None``: the plan decides; the word "auto" reads as None) or 0 for sizes are filled in by
the plan. The
``plugins`` a config names are imported before it is checked (:mod:`rlctl.config.plugins`), so the names
they register are valid ``algo.adv`` / ``algo.policy_loss`` values (:mod:`rlctl.config.algorithm`).

This module imports no torch, so the CLI can use it while staying fast.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

from rlctl.config.algorithm import check_registered_names
from rlctl.config.plugins import load_plugins
from rlctl.config.schema import (  # noqa: F401 - the schema, re-exported
    AgentConfig,
    AlgoConfig,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    HardwareConfig,
    LogConfig,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    PrefConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainConfig,
)
from rlctl.errors import UserError, did_you_mean
from rlctl.names import RL_METHODS, Method, choices

METHODS = choices(Method)


# ---------------------------------------------------------------------------------------------
# Building a typed config from layered dicts


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check (and gently convert) one value against a dataclass field type."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return _choice(value, typing.get_args(tp), key)
    if origin in (typing.Union, types.UnionType):
        if set(typing.get_args(tp)) == {bool, type(None)}:
            return _bool_or_none(value, key)
        if type(None) in typing.get_args(tp) and is_auto(value):
            return None
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, key)
            except UserError as e:
                errors.append(str(e))
        raise UserError(errors[0] if errors else f"{key}: cannot be {value!r}")
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key} must be a list, got {value!r}")
        return [_coerce(v, item_tp, key) for v in value]
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise UserError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise UserError(f"{key} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise UserError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise UserError(f"{key} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise UserError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise UserError(f"{key} must be a string, got {value!r}")
    raise UserError(f"{key}: unsupported type {_type_name(tp)}")


def is_auto(value: Any) -> bool:
    """The word "auto" (YAML, --set, the CLI, older configs) for a setting the plan decides: read as None."""
    return isinstance(value, str) and value.strip().lower() == "auto"


def _bool_or_none(value: Any, key: str) -> bool | None:
    """A setting the plan decides when None; "auto" (YAML, --set, older configs) reads as None."""
    if value is None or is_auto(value):
        return None
    try:
        return _coerce(value, bool, key)
    except UserError:
        raise UserError(f"{key} must be true, false or auto (the plan decides), got {value!r}") from None


def _choice(value: Any, allowed: tuple[str, ...], key: str) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str) and value in allowed:
        return value
    raise UserError(
        f"{key}={value!r} is not valid{did_you_mean(str(value), allowed)}; choose one of {', '.join(allowed)}"
    )


def _apply(obj: Any, updates: dict, prefix: str = "", *, method: str = "sft") -> None:
    """Apply a nested dict of updates onto a dataclass instance, validating every key."""
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    for key, value in updates.items():
        path = f"{prefix}{key}"
        if key not in names:
            all_keys = [f"{prefix}{n}" for n in names]
            raise UserError(
                f"unknown config key '{path}'{did_you_mean(path, all_keys + all_config_keys())}; "
                f"`rlctl presets show {method}` lists the keys"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise UserError(
                    f"'{path}' is a section; set one of its keys, e.g. {path}.{dataclasses.fields(current)[0].name}=..."
                )
            _apply(current, value, prefix=f"{path}.", method=method)
        else:
            setattr(obj, key, _coerce(value, hints[key], path))


def all_config_keys() -> list[str]:
    """Every dotted key of the configuration, e.g. ``train.lr``."""
    keys = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            else:
                keys.append(f"{prefix}{f.name}")

    walk(RunConfig, "")
    return keys


def dotted_to_nested(items: dict[str, Any]) -> dict:
    """{"train.lr": 1e-5} -> {"train": {"lr": 1e-5}}."""
    nested: dict = {}
    for key, value in items.items():
        parts = key.split(".")
        node = nested
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UserError(f"'{key}' conflicts with another setting of '{p}'")
        node[parts[-1]] = value
    return nested


def parse_set_options(items: list[str]) -> dict:
    """Parse repeated ``--set key=value`` options; values are read as YAML scalars."""
    import yaml

    out: dict[str, Any] = {}
    for item in items or []:
        if "=" not in item:
            raise UserError(f"--set expects key=value, got '{item}' (e.g. --set train.lr=2e-5)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key:
            raise UserError(f"--set expects key=value, got '{item}'")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        out[key] = value
    return dotted_to_nested(out)


def load_yaml_file(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {p} (pass an existing YAML file to --config)")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0]
        raise UserError(f"{p} is not valid YAML: {first}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p} must hold a mapping of config sections (e.g. train: {{lr: 1e-5}})")
    if "${" in p.read_text():  # omegaconf interpolation: ${train.lr}, ${oc.env:VAR,default}
        from omegaconf import OmegaConf

        try:
            data = OmegaConf.to_container(OmegaConf.create(data), resolve=True)
        except Exception as e:  # noqa: BLE001 (omegaconf raises several types)
            raise UserError(f"{p}: cannot resolve an interpolation: {str(e).splitlines()[0]}") from None
    return data


def build_config(method: str, layers: list[dict]) -> RunConfig:
    """Apply layers (lowest precedence first) onto the defaults for ``method``."""
    if method not in METHODS:
        raise UserError(f"unknown method '{method}'{did_you_mean(method, METHODS)}; use one of {', '.join(METHODS)}")
    cfg = RunConfig(method=method)
    for layer in layers:
        if layer:
            layer = dict(layer)
            layer.pop("method", None)
            _apply(cfg, layer, method=method)
    cfg.plugins = load_plugins(cfg.plugins)  # before validate: a plugin's names are valid choices
    validate(cfg)
    if cfg.train.lr_scheduler == "constant":
        cfg.train.min_lr_ratio = 1.0
    return cfg


def val_split(cfg: RunConfig) -> str:
    """The split read from ``data.val_path`` when it is a hub dataset or a DatasetDict directory."""
    return cfg.data.val_split or "test"


SAVE_EVERY_MIN = 50  # auto: never a checkpoint more often than this many steps
SAVE_EVERY_COUNT = 10  # auto: about this many checkpoints over a run


def total_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    """The optimizer steps of a run: ``train.max_steps``, else ``train.epochs`` over the data
    (``steps_per_epoch``: known once the data is read, so each recipe asks here with its sampler's)."""
    return cfg.train.max_steps or cfg.train.epochs * steps_per_epoch


def save_every_steps(save_every: int, total_steps: int) -> int:
    """The checkpoint interval in steps (0 = only the final checkpoint). ``checkpoint.save_every = -1``
    (auto, the default) checkpoints about 10 times over a long run and never more often than every 50
    steps: every ``max(50, ceil(total_steps / 10))`` steps (a 20-step run: only at the end; 1,000
    steps: every 100)."""
    if save_every >= 0:
        return save_every
    return max(SAVE_EVERY_MIN, -(-total_steps // SAVE_EVERY_COUNT))


def _literal_choices() -> dict[str, tuple[str, ...]]:
    """Every enumerated key of the schema and its values, read from its Literal type (:mod:`rlctl.names`)."""
    out: dict[str, tuple[str, ...]] = {}

    def walk(cls: type, prefix: str) -> None:
        for name, tp in typing.get_type_hints(cls).items():
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.")
                continue
            options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
            for option in options:  # LossAgg | None: the Literal's values
                if typing.get_origin(option) is typing.Literal:
                    out[f"{prefix}{name}"] = typing.get_args(option)

    walk(RunConfig, "")
    return out


CHOICES = _literal_choices()  # e.g. {"rollout.engine": ("hf", "vllm", "sglang"), ...}


def get_key(cfg: RunConfig, key: str) -> Any:
    obj: Any = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: RunConfig) -> None:
    """Checks that do not need the catalog: choices and value ranges."""
    for key, allowed in CHOICES.items():
        value = get_key(cfg, key)
        if value is not None and value not in allowed:
            raise UserError(
                f"{key}={value!r} is not valid{did_you_mean(str(value), allowed)}; choose one of {', '.join(allowed)}"
            )
    check_registered_names(cfg)
    positive = "train.batch_size train.max_len train.epochs rollout.n hardware.nodes rollout.max_prompt_len"
    positive += " rollout.max_response_len algo.ppo_epochs rollout.val_n checkpoint.keep_last"
    positive += " hardware.collective_timeout_min"
    for key in positive.split():
        if get_key(cfg, key) < 1:
            raise UserError(f"{key} must be at least 1, got {get_key(cfg, key)}")
    non_negative = "train.max_steps train.micro_batch_size hardware.gpus hardware.nproc parallel.tp parallel.pp"
    non_negative += " rollout.tp lora.rank train.eval_every log.samples_every log.samples lora.dropout algo.kl_coef"
    non_negative += " train.weight_decay algo.entropy_coef algo.critic_lr train.lr algo.mini_batch_size"
    for key in non_negative.split():
        if get_key(cfg, key) < 0:
            raise UserError(f"{key} must not be negative, got {get_key(cfg, key)}")
    ranges = {
        "rollout.mem_fraction": "[0, 1)",
        "rollout.eval_mem_fraction": "[0, 1)",
        "data.val_fraction": "[0, 1)",
        "train.warmup_ratio": "[0, 1)",
    }
    ranges["rollout.top_p"] = "(0, 1]"
    for key, text in ranges.items():
        v = get_key(cfg, key)
        if not ((0.0 <= v < 1.0) if text == "[0, 1)" else (0.0 < v <= 1.0)):
            raise UserError(f"{key} must be in {text}, got {v}")
    if cfg.algo.dual_clip and cfg.algo.dual_clip <= 1.0:
        raise UserError(f"algo.dual_clip must be > 1 (or 0 to turn it off), got {cfg.algo.dual_clip}")
    if cfg.checkpoint.save_every < -1:
        raise UserError(
            f"checkpoint.save_every must be -1 (auto), 0 (at the end only) or N, got {cfg.checkpoint.save_every}"
        )
    if cfg.rollout.top_k == 0 or cfg.rollout.top_k < -1:
        raise UserError(f"rollout.top_k must be -1 (off) or at least 1, got {cfg.rollout.top_k}")
    _validate_agent(cfg)


def agent_enabled(cfg: RunConfig) -> bool:
    """Whether the run is multi-turn: tools, an environment or an interaction given."""
    a = cfg.agent
    return bool(a.tools or a.env or a.interaction)


def _validate_agent(cfg: RunConfig) -> None:
    a = cfg.agent
    if a.max_turns is not None and a.max_turns < 1:
        raise UserError(f"agent.max_turns must be at least 1, got {a.max_turns}")
    if a.tool_timeout_s <= 0:
        raise UserError(f"agent.tool_timeout_s must be > 0 seconds, got {a.tool_timeout_s}")
    if a.tool_max_chars < 1:
        raise UserError(f"agent.tool_max_chars must be at least 1, got {a.tool_max_chars}")
    if agent_enabled(cfg) and cfg.method not in RL_METHODS:
        raise UserError(
            f"--tools / --env / --interaction are for grpo and ppo; {cfg.method} trains on the data's tool traces"
        )


# A setting that would have no effect, and what it needs: the one rule for every such flag (issue 37). A
# setting counts as given when an option or --set names it, or a --config file gives it a non-default value.
NEEDS: dict[str, tuple[typing.Callable[[RunConfig], bool], str]] = {
    "agent.max_turns": (
        agent_enabled,
        "--max-turns needs something to take turns with: pass --tools FILE.py, --env FILE.py:Class or "
        "--interaction FILE",
    ),
    "rollout.max_staleness": (
        lambda cfg: cfg.rollout.procs > 0,
        "--max-staleness is how far the rollout processes may run behind the trainer, so it needs "
        "--rollout-procs N (without it every step is synchronous); drop it or pass --rollout-procs",
    ),
}


def flat_keys(nested: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-5}} -> {"train.lr": 1e-5}."""
    out: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict) and value:
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_no_effect(cfg: RunConfig, *, named: dict[str, Any], config_file: dict[str, Any]) -> None:
    """Refuse a setting that would have no effect (:data:`NEEDS`): ``named`` by an option or --set, or set
    to a non-default value by the --config file (a saved config.yaml holds every default)."""
    defaults = RunConfig(method=cfg.method)
    for key, (takes_effect, message) in NEEDS.items():
        given = key in named or (key in config_file and config_file[key] != get_key(defaults, key))
        if given and not takes_effect(cfg):
            raise UserError(message)


def save_config(cfg: RunConfig, path: str | Path) -> None:
    import yaml

    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def load_config(path: str | Path) -> RunConfig:
    """Read a resolved config.yaml that rlctl wrote (e.g. into a run directory)."""
    data = load_yaml_file(path)
    return build_config(data.get("method", "sft"), [data])
