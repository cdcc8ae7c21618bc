"""Every check that can be made before torchrun starts, in well under a second (:func:`check_job`; a
dry run's share: :func:`check_dry_run`): the settings, the data's first rows, the model's config.json, the
machine's GPUs, the plan's memory verdict, the run directory's checkpoints. Each problem is one
:class:`~rlctl.errors.UserError` naming the fix; nothing is written here.

Called by :func:`rlctl.job.ready_to_launch` (and ``rlctl sft|grpo|ppo --dry-run``); the checks of the files a
job touches are :mod:`rlctl.preflight`'s. No torch import here.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from rlctl.config import RunConfig, val_split
from rlctl.config.algorithm import check_algorithm
from rlctl.errors import UserError
from rlctl.names import PAIR_METHODS, RL_METHODS
from rlctl.support import SPLIT_RULES, JobFacts, refuse

if TYPE_CHECKING:
    from rlctl.plan import Plan

IGNORE_MEMORY_FLAG = "--ignore-memory-check"


def check_job(cfg: RunConfig, plan, *, ignore_memory_check: bool = False, on_this_machine: bool = True) -> None:
    """Every check before launch, cheapest first; the first problem is a one-line UserError.
    ``on_this_machine=False`` (a job submitted to other machines, e.g. by SLURM): no local device check."""
    from rlctl.preflight import check_model_available

    check_data_given(cfg)
    model = model_files(cfg.model.name)
    warnings = check_settings(cfg, plan, model)
    check_memory(plan, ignore=ignore_memory_check)
    if on_this_machine:
        check_device(plan)
    if cfg.output_dir:
        check_run_dir(cfg, Path(cfg.output_dir), backend=plan.backend)
    if model is None and on_this_machine:
        check_model_available(cfg.model.name, random_init=cfg.model.random_init)
    if on_this_machine:
        check_teacher(cfg, model, on_this_machine=True)  # a teacher named but not here or in the hub cache
    check_data_rows(cfg, model)
    for line in warnings:
        print(line, file=sys.stderr, flush=True)


def check_dry_run(cfg: RunConfig, plan) -> None:
    """What ``--dry-run`` checks: every refusal of :func:`check_settings`, as the launch would; it plans
    without the data's rows or a downloaded model, but the data files it names must exist and read."""
    check_settings(cfg, plan, model_files(cfg.model.name))
    if cfg.data.path:  # the files exist and read (their columns are checked by the real run)
        from rlctl.data.io import first_rows

        check_data_given(cfg)
        for path in (cfg.data.path, cfg.data.val_path):
            if path:
                first_rows(path)


def check_settings(cfg: RunConfig, plan, model: ModelFiles | None) -> list[str]:
    """What a dry run and the launch both refuse (the settings, the files they name, a local model's own
    files); the console warnings of the launch come back."""
    from rlctl.metrics import check_backends_installed
    from rlctl.preflight import check_footguns, check_image_processor, check_tokenizer

    nproc = int(plan.nproc_per_node or 1)
    check_algorithm(cfg)
    check_split(cfg, nproc=nproc, nodes=int(plan.nodes or 1))
    check_reward_spec(cfg)
    check_agent_files(cfg)
    check_backends_installed(cfg.log.backends)
    check_profile_env()
    warnings = check_footguns(cfg, nproc=nproc, device=plan.device)
    if model is not None:
        check_tokenizer(model.root)
        check_image_processor(model.root)
        check_remote_code(cfg, model)
        check_context(cfg, model)
        if cfg.method == "rm":
            from rlctl.rewards.model import classifier_architecture

            classifier_architecture(model.config.get("architectures"), cfg.model.name)
    check_agent_template(cfg, model)
    check_teacher(cfg, model, on_this_machine=False)  # a local teacher's vocabulary; a hub one is not fetched
    return warnings


def check_placement(plan: Plan) -> None:
    """Where the ranks go (checked for a dry run too): a vLLM/SGLang engine's tensor parallel stays inside one node."""
    if plan.nodes > 1 and plan.rollout in ("vllm", "sglang") and plan.rollout_tp > 1:
        from rlctl.runtime.dist import check_rollout_in_node  # (imports torch: only for multi-node RL)

        check_rollout_in_node(plan.rollout_tp, plan.nproc_per_node)


# ---------------------------------------------------------------------------------------------
# Inputs


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


def check_profile_env() -> None:
    """``RLCTL_PROFILE`` (rlctl.runtime.profile) is START:END or N; a typo fails here, not after the run."""
    from rlctl.runtime.profile import PROFILE_ENV, parse_steps

    value = os.environ.get(PROFILE_ENV, "")
    if value.strip() and parse_steps(value) is None:
        raise UserError(
            f"{PROFILE_ENV}={value!r} is not a step range: use START:END (1-based, e.g. 3:6) or one step N, or unset it"
        )


def check_reward_spec(cfg: RunConfig) -> None:
    if cfg.method in ("grpo", "ppo"):
        from rlctl.rewards import check_reward_config

        check_reward_config(cfg.reward)  # an unknown name, a missing file/function or model: a UserError


def check_split(cfg: RunConfig, *, nproc: int, nodes: int) -> None:
    """One-step-off-policy (``rollout.procs``, docs/offpolicy.md): what the split supports (rlctl.support)."""
    refuse(JobFacts.of(cfg, world=nproc * nodes, nodes=nodes), *SPLIT_RULES)


def check_agent_files(cfg: RunConfig) -> None:
    """--tools / --env / --interaction load here as on the ranks (torch-free): a file that does not import,
    a tool without a documented argument, a missing class or a bad verl YAML is one line before launch."""
    a = cfg.agent
    if cfg.method in ("grpo", "ppo") and (a.tools or a.env or a.interaction):
        from rlctl.agents.tools import load_agent_spec

        load_agent_spec(tools=a.tools, env=a.env, interaction=a.interaction, timeout_s=a.tool_timeout_s)


def check_reward_source(cfg: RunConfig, rows: list[dict]) -> None:
    """An agent run whose rewards would all be zero trains on nothing: refused, as TRL refuses it ("No reward
    source provided"). Its sources: a rule reward or model that applies to the rows, or an environment reward
    with a weight (get_reward: 1 by default; verl's tool and interaction rewards: 0 unless --reward tool:W)."""
    a = cfg.agent
    if cfg.method not in ("grpo", "ppo") or not (a.tools or a.env or a.interaction):
        return
    from rlctl.agents.tools import load_agent_spec
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


def check_run_dir(cfg: RunConfig, run_dir: Path, *, backend: str = "") -> None:
    """An output that cannot be written or is someone else's directory; a bad or damaged --resume
    checkpoint, or one this job cannot continue (another method, engine, LoRA rank or model); a run
    directory that already holds checkpoints without --resume. Nothing in ``run_dir`` changes."""
    from rlctl.preflight import check_output_dir, check_resume_compatible
    from rlctl.runtime.layout import choose_resume, latest_checkpoint

    resume = cfg.checkpoint.resume
    check_output_dir(run_dir, resume=bool(resume))
    if resume:  # checks every file of the checkpoint it picks (imports torch's DCP classes to read .metadata)
        choice = choose_resume(resume, run_dir)
        if choice.path is not None:
            check_resume_compatible(cfg, choice.path, backend)
        if choice.note():
            print(choice.note(), flush=True)  # --resume auto passed over a damaged checkpoint: say which and why
    if not resume and latest_checkpoint(run_dir / "checkpoints") is not None:
        raise UserError(
            f"{run_dir} already holds checkpoints; pass --resume auto to continue that run "
            f"or choose another --output-dir"
        )


# ---------------------------------------------------------------------------------------------
# Machine and plan


def gpu_visible() -> bool:
    """Whether this machine shows a CUDA GPU, without importing torch (device nodes and CUDA_VISIBLE_DEVICES)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*")) or bool(glob.glob("/dev/dxg"))


def check_device(plan) -> None:
    if plan.device == "cuda" and not gpu_visible():
        raise UserError("the plan asks for CUDA but no GPU is visible; pass --device cpu (or run on a GPU machine)")


def check_memory(plan, *, ignore: bool) -> None:
    """The planner's "does not fit" verdict stops a real launch (as it is printed by --dry-run), with what
    would fit (the plan's advice)."""
    if plan.fits or ignore:
        return
    from rlctl.plan.types import advice_line

    parts = [f"the plan does not fit in memory: {plan.verdict.why}"]
    if plan.advice:
        parts.append(advice_line(plan.advice).rstrip("."))
    parts.append(f"pass {IGNORE_MEMORY_FLAG} to launch anyway")
    raise UserError(" ".join("; ".join(parts).split()))


# ---------------------------------------------------------------------------------------------
# Model


@dataclasses.dataclass
class ModelFiles:
    """What a local model directory says about itself, from its JSON files only."""

    root: Path
    config: dict
    tokenizer_config: dict

    @property
    def has_chat_template(self) -> bool:
        tc = self.tokenizer_config.get("chat_template")
        return bool(tc) or (self.root / "chat_template.jinja").is_file() or (self.root / "chat_template.json").is_file()


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path}: {str(e).splitlines()[0]}; pass a valid HF model directory") from None
    return data if isinstance(data, dict) else {}


def model_files(name: str) -> ModelFiles | None:
    """The config of a local model (a directory with config.json, or the config.json itself); None otherwise
    (a catalog name or a hub id: the planner already knows its shape)."""
    p = Path(name).expanduser()
    if p.name == "config.json" and p.is_file():
        p = p.parent
    if not (p / "config.json").is_file():
        return None
    tok = p / "tokenizer_config.json"
    return ModelFiles(p, _read_json(p / "config.json"), _read_json(tok) if tok.is_file() else {})


@cache
def known_model_types() -> frozenset[str]:
    """The model types this transformers builds natively, read from its source (importing it takes seconds)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    found: set[str] = set()
    for name in ("auto_mappings.py", "configuration_auto.py"):  # where the mapping lives moves between versions
        try:
            text = (models / "auto" / name).read_text()
        except OSError:
            continue
        found.update(re.findall(r'"([\w-]+)"\s*[:,]\s*"\w+Config"', text))
    return frozenset(found)


def check_remote_code(cfg: RunConfig, model: ModelFiles) -> None:
    """A model whose config names its own code (auto_map) for a type transformers does not know."""
    if cfg.model.trust_remote_code or "auto_map" not in model.config:
        return
    model_type = str(model.config.get("model_type", ""))
    known = known_model_types()
    if (known and model_type in known) or (not known and model_type):
        return  # transformers builds it natively (or its mapping could not be read: let it decide)
    raise UserError(
        f"{model.root} needs its own Python code (config.json auto_map, model_type {model_type or '?'!r} unknown to "
        f"transformers); pass --trust-remote-code if you trust it (or --set model.trust_remote_code=true)"
    )


def context_length(model: ModelFiles) -> int:
    cfg = model.config.get("text_config") if isinstance(model.config.get("text_config"), dict) else model.config
    value = cfg.get("max_position_embeddings") or cfg.get("n_positions") or 0
    return int(value) if isinstance(value, int | float) else 0


def check_context(cfg: RunConfig, model: ModelFiles) -> None:
    """RL: prompt + response within the model's positions (max_position_embeddings): the rollout engine
    refuses a longer context (vLLM's max_model_len), minutes into the job."""
    ctx = context_length(model)
    if not ctx:
        return
    if cfg.method not in RL_METHODS:  # rows longer than max_len are skipped or cut; the positions stretch (RoPE)
        return
    r = cfg.rollout
    if r.max_prompt_len + r.max_response_len > ctx:
        raise UserError(
            f"rollout.max_prompt_len + rollout.max_response_len = {r.max_prompt_len} + {r.max_response_len} is "
            f"longer than the model's context of {ctx} tokens (max_position_embeddings in "
            f"{model.root / 'config.json'}); lower --max-prompt-len / --max-response-len to sum to {ctx} or less"
        )


def check_teacher(cfg: RunConfig, model: ModelFiles | None, *, on_this_machine: bool) -> None:
    """On-policy distillation: the teacher exists and has the student's vocabulary (compared from the local
    tokenizer files of both; a model only on the hub is compared on the ranks)."""
    name = cfg.algo.teacher
    if not name or cfg.method not in RL_METHODS:
        return
    teacher = model_files(name)
    if teacher is None:
        if on_this_machine:
            from rlctl.preflight import check_model_available

            check_model_available(name, random_init=False)
        return
    from rlctl.config.algorithm import teacher_vocab_problem

    student_vocab = tokenizer_vocab(model.root) if model is not None else None
    teacher_vocab = tokenizer_vocab(teacher.root)
    if student_vocab is None or teacher_vocab is None:
        return
    problem = teacher_vocab_problem(student_vocab, teacher_vocab, cfg.model.name, name)
    if problem:
        raise UserError(problem)


def tokenizer_vocab(root: Path) -> dict[str, int] | None:
    """token -> id of a local tokenizer (tokenizer.json's model vocab and added tokens, else vocab.json);
    None when neither is there or readable."""
    if (root / "tokenizer.json").is_file():
        tok = _read_json(root / "tokenizer.json")
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...] in id order
            vocab = {piece[0]: i for i, piece in enumerate(vocab)}
        if not isinstance(vocab, dict):
            return None
        added = {t["content"]: t["id"] for t in tok.get("added_tokens") or [] if isinstance(t, dict) and "id" in t}
        return {**vocab, **added}
    if (root / "vocab.json").is_file():
        return _read_json(root / "vocab.json")
    return None


# ---------------------------------------------------------------------------------------------
# Data (its first rows)


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
