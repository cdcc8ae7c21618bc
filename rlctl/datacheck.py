"""What a job reads besides the model, checked before launch: the data given and its first rows (columns, answers,
a reward for every row), the reward functions, the agent's tool, environment and interaction files and a chat
template that renders tool calls. Called by :mod:`rlctl.checks`; each problem is one
:class:`~rlctl.errors.UserError` naming the fix. No torch import here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlctl.config import RunConfig, val_split
from rlctl.errors import UserError
from rlctl.names import PAIR_METHODS

if TYPE_CHECKING:
    from rlctl.modelfiles import ModelFiles


def check_data_given(cfg: RunConfig) -> None:
    if not cfg.data.path and cfg.method in ("grpo", "ppo") and cfg.agent.env:
        if not cfg.train.max_steps:  # TRL's rule too: the environment owns the data, the steps bound the run
            raise UserError(
                "no --data: the environment samples its own tasks (its reset() returns each prompt); set the run's "
                "length with --max-steps N"
            )
        check_reward_source(cfg, [])
        return
    if not cfg.data.path:
        raise UserError(
            f"no data given: pass --data FILE (JSONL, Parquet or a datasets directory) to `rlctl {cfg.method}`"
        )
    from rlctl.data.io import check_source

    if cfg.data.chat_template and not Path(cfg.data.chat_template).expanduser().is_file():
        raise UserError(f"chat template file not found: {cfg.data.chat_template} (--chat-template takes a Jinja file)")

    for key in ("path", "val_path"):
        value = getattr(cfg.data, key)
        if value:
            check_source(value, f"data.{key}", cfg.data.split if key == "path" else val_split(cfg))


def check_reward_spec(cfg: RunConfig) -> None:
    if cfg.method in ("grpo", "ppo"):
        from rlctl.rewards import check_reward_config

        check_reward_config(cfg.reward)  # an unknown name, a missing file/function or model: a UserError


def check_agent_files(cfg: RunConfig) -> None:
    """--tools / --env / --interaction load here as on the ranks (torch-free): a file that does not import,
    a tool without a documented argument, a missing class or a bad verl YAML is one line before launch."""
    a = cfg.agent
    if cfg.method in ("grpo", "ppo") and (a.tools or a.env or a.interaction):
        from rlctl.agents.spec import load_agent_spec

        load_agent_spec(tools=a.tools, env=a.env, interaction=a.interaction, timeout_s=a.tool_timeout_s)


def check_reward_source(cfg: RunConfig, rows: list[dict]) -> None:
    """An agent run whose rewards would all be zero trains on nothing: refused, as TRL refuses it ("No reward
    source provided"). Its sources: a rule reward or model that applies to the rows, or an environment reward
    with a weight (get_reward: 1 by default; verl's tool and interaction rewards: 0 unless --reward tool:W)."""
    a = cfg.agent
    if cfg.method not in ("grpo", "ppo") or not (a.tools or a.env or a.interaction):
        return
    from rlctl.agents.spec import load_agent_spec
    from rlctl.rewards.loader import default_for_data_source
    from rlctl.rewards.manager import env_weight
    from rlctl.rewards.spec import ENV_REWARDS, rule_specs

    specs = rule_specs(cfg.reward)
    given = {s.spec: s.weight for s in specs if s.spec in ENV_REWARDS}
    sources = {str(r.get("data_source") or "") for r in rows}
    auto = any(s.spec == "auto" for s in specs) and sources and all(default_for_data_source(x) for x in sources)
    if auto or cfg.reward.model or any(s.spec != "auto" and s.spec not in ENV_REWARDS for s in specs):
        return
    spec = load_agent_spec(tools=a.tools, env=a.env, interaction=a.interaction, timeout_s=a.tool_timeout_s)
    produced = spec.reward_names() if spec is not None else set()
    if any(env_weight(n, given) != 0 for n in produced):
        return
    fixes = ["--reward FILE.py:function"]
    fixes += [f"a get_reward() method in {a.env}"] if a.env and "env" not in produced else []
    fixes += [f"--reward {n}:1" for n in sorted(produced - {"env"})]  # verl's rewards, weight 0 by default
    raise UserError(
        "no reward source: no --reward, no environment get_reward, and no row's data_source has a built-in "
        f"reward (TRL refuses this too: 'No reward source provided'); add {' or '.join(fixes)}"
    )


def check_agent_template(cfg: RunConfig, model: ModelFiles | None) -> None:
    """An agent run (--tools / --env / --interaction) needs a chat template that renders tool calls."""
    if not (cfg.agent.tools or cfg.agent.env):  # an interaction alone calls no tools
        return
    from rlctl.agents.parse import template_style

    template: object = None
    if cfg.data.chat_template:
        template = Path(cfg.data.chat_template).expanduser().read_text()
    elif model is not None:
        template = model.tokenizer_config.get("chat_template")
        jinja = model.root / "chat_template.jinja"
        if not template and jinja.is_file():
            template = jinja.read_text()
    else:
        return  # a hub model: its template is read on the ranks
    if template_style(template) is None and "response_schema" not in (model.tokenizer_config if model else {}):
        raise UserError(
            "the chat template has no tool-call format (no <tool_call> nor Llama 3 JSON calls), so the model cannot "
            "call --tools / --env: use a model whose template takes tools, or pass --chat-template FILE.jinja"
        )


def check_data_rows(cfg: RunConfig, model: ModelFiles | None) -> None:
    from rlctl.data.io import first_rows

    for key in ("path", "val_path"):
        path = getattr(cfg.data, key)
        if not path:
            continue
        found = first_rows(path)
        if found is None:
            continue
        rows, columns = found
        if not rows:
            raise UserError(f"{path} holds no rows (data.{key}); pass a file with at least one row")
        if cfg.method == "sft":
            _check_sft_rows(cfg, path, rows, columns, model)
        elif cfg.method in PAIR_METHODS:
            _check_pref_rows(cfg, path, rows, columns)
        else:
            _check_rl_rows(cfg, path, rows, columns)


def _columns(columns: list[str]) -> str:
    return ", ".join(columns[:12]) + (", ..." if len(columns) > 12 else "") if columns else "none"


def _check_sft_rows(cfg: RunConfig, path: str, rows: list[dict], columns: list[str], model: ModelFiles | None):
    d = cfg.data
    chat = d.format == "chat" or (d.format is None and any(d.messages_field in r for r in rows))
    if chat:
        if not any(d.messages_field in r for r in rows):
            raise UserError(
                f"{path}: no '{d.messages_field}' column (the rows have {_columns(columns)}); "
                f"name the messages with --set data.messages_field=FIELD"
            )
        if model is not None and not model.has_chat_template and not d.chat_template:
            raise UserError(
                f"{model.root} has no chat template, and {path} holds chat messages; use a model with a chat "
                f"template (tokenizer_config.json chat_template) or prompt/response rows (--set data.format=pairs)"
            )
        return
    if d.format == "rl":
        raise UserError("data.format=rl is for grpo/ppo; sft reads chat (messages) or pairs (prompt/response) rows")
    if not any(d.prompt_field in r and d.response_field in r for r in rows):
        raise UserError(
            f"{path}: sft needs a '{d.messages_field}' column or '{d.prompt_field}' and '{d.response_field}' "
            f"columns; the rows have {_columns(columns)} (name them with --set data.messages_field=... or "
            f"data.prompt_field=... data.response_field=...)"
        )


def _check_pref_rows(cfg: RunConfig, path: str, rows: list[dict], columns: list[str]) -> None:
    """dpo / rm: the first rows parse in one of the preference layouts (rlctl.data.preference)."""
    from rlctl.data.preference import parse_row
    from rlctl.data.sft import BadRow

    reasons = []
    for r in rows:
        try:
            parse_row(r, cfg)
            return
        except BadRow as e:
            reasons.append(str(e))
    c, rj = cfg.pref.chosen_field, cfg.pref.rejected_field
    raise UserError(
        f"{path}: no row of the first {len(rows)} is a preference row ({reasons[0]}); the rows have "
        f"{_columns(columns)}. rlctl {cfg.method} reads '{cfg.data.prompt_field}'/'{c}'/'{rj}' (TRL), "
        f"'{cfg.data.prompt_field}'/'{cfg.pref.completion_field}'/'{cfg.pref.label_field}' (kto) or "
        f"LLaMA-Factory's alpaca/sharegpt pairs (docs/dpo.md); name the columns with "
        f"--set pref.chosen_field=... pref.rejected_field=..."
    )


def _check_rl_rows(cfg: RunConfig, path: str, rows: list[dict], columns: list[str]) -> None:
    d = cfg.data
    if d.format not in (None, "rl"):
        raise UserError(f"data.format={d.format} is for sft; grpo/ppo read RL prompt rows (data.format=rl or unset)")
    if not any(d.prompt_field in r for r in rows):
        raise UserError(
            f"{path}: no '{d.prompt_field}' column (the rows have {_columns(columns)}); "
            f"name the prompt with --set data.prompt_field=FIELD"
        )

    def has_answer(r: dict) -> bool:
        rm = r.get("reward_model")
        return (isinstance(rm, dict) and "ground_truth" in rm) or d.answer_field in r

    from rlctl.rewards.loader import default_for_data_source
    from rlctl.rewards.spec import needs_answer, rule_specs

    if needs_answer(cfg) and not any(has_answer(r) for r in rows):
        raise UserError(
            f"{path}: no row has an answer field '{d.answer_field}' (nor verl's reward_model.ground_truth); "
            f"the rows have {_columns(columns)}: name the answer with --set data.answer_field=FIELD"
        )
    check_reward_source(cfg, rows)
    if all(s.spec != "auto" for s in rule_specs(cfg.reward)):
        return  # every component is named (or a reward model alone): no row needs a data_source
    if cfg.agent.env or cfg.agent.interaction:
        return  # the environment's get_reward (TRL's convention) or a weighted interaction scores the rows

    sources = {str(r.get("data_source") or "") for r in rows}
    if "" in sources:
        raise UserError(
            f"{path}: rows without a data_source, so no reward can be chosen for them; pass --reward "
            f"(gsm8k | math | exact | format | length | file.py:fn)"
        )
    unknown = sorted(s for s in sources if default_for_data_source(s) is None)
    if unknown:
        raise UserError(
            f"{path}: data_source {', '.join(map(repr, unknown[:3]))} has no built-in reward; pass --reward "
            f"(gsm8k | math | exact | format | length | file.py:fn)"
        )
