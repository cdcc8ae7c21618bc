"""The run config `rlctl eval` reads its data and reward settings from (no torch).

Layers, lowest first: the run's own ``config.yaml`` when MODEL_OR_RUN is (or is inside) a run directory
(only the keys that decide how a prompt is rendered and scored: :data:`FROM_RUN`), then the command's
options, then ``--set key=value``. So a run is evaluated with the prompt field, answer field, system prompt,
length limits and rewards it was trained with, unless the command says otherwise.
"""

from __future__ import annotations

from pathlib import Path

from rlctl.config import RunConfig, build_config, dotted_to_nested, load_yaml_file, parse_set_options
from rlctl.errors import UserError

FROM_RUN = {
    "data": ("prompt_field", "answer_field", "system_prompt", "max_image_pixels"),
    "rollout": ("max_prompt_len", "max_response_len"),
    "reward": None,  # the whole section
}


def run_config_file(model_or_run: Path) -> Path | None:
    """The ``config.yaml`` of the run that ``model_or_run`` is or lies in (up to three levels up), if any."""
    p = model_or_run.expanduser().absolute()
    for d in [p, *list(p.parents)[:3]]:
        if (d / "config.yaml").is_file():
            return d / "config.yaml"
    return None


def run_layer(config_file: Path | None) -> dict:
    """The keys of :data:`FROM_RUN` in a run's config.yaml."""
    if config_file is None:
        return {}
    data = load_yaml_file(config_file)
    out: dict = {}
    for section, keys in FROM_RUN.items():
        values = data.get(section)
        if isinstance(values, dict):
            out[section] = dict(values) if keys is None else {k: values[k] for k in keys if k in values}
    return out


def eval_config(model_or_run: Path, options: dict[str, object], sets: list[str]) -> tuple[RunConfig, Path | None]:
    """The config of an eval (and the run config.yaml it started from); ``options`` are dotted keys
    (None: not given)."""
    config_file = run_config_file(model_or_run)
    given = {k: v for k, v in options.items() if v is not None}
    layers = [run_layer(config_file), dotted_to_nested(given), parse_set_options(sets)]
    cfg = build_config("grpo", layers)
    from rlctl.rewards.spec import check_reward_config

    check_reward_config(cfg.reward)
    if cfg.data.format not in (None, "rl"):
        raise UserError(f"data.format={cfg.data.format} is for sft; eval reads RL prompt rows (data.format=rl)")
    return cfg, config_file


def load_tools(cfg: RunConfig):
    """The agent spec (tools / environment) of ``cfg``, loaded before any model (torch-free; a bad path or
    function is a one-line UserError), or None without tools."""
    from rlctl.recipes.rl.turns import load_agent

    return load_agent(cfg)


def chat_tools(tools: str, max_turns: int, max_new_tokens: int):
    """``(cfg, spec)`` for `rlctl chat --tools`: the agent settings training would use, or None without tools."""
    if not tools:
        return None
    layer = {"agent": {"tools": tools, "max_turns": max_turns}, "rollout": {"max_response_len": max_new_tokens}}
    cfg = build_config("grpo", [layer])
    return cfg, load_tools(cfg)
