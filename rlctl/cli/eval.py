"""`rlctl eval MODEL_OR_RUN --data FILE`: accuracy and pass@k of a model or run, scored as training scores.

A thin command over rlctl.evaluate (imported inside: --help stays fast). Every bad input is one line
before the model loads: a missing model or data file, a data file without rows, k > n, a directory
that is neither a model (config.json) nor a run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rlctl.names import ROLLOUT_ENGINES

EXAMPLES = """
Examples:

  rlctl eval runs/grpo --data test.jsonl                       # greedy accuracy, the run's rewards

  rlctl eval ./Qwen2.5-0.5B-Instruct --data gsm8k_test.parquet --n 8 --k 1 --k 8 --temperature 0.7

  rlctl eval runs/grpo --data test.jsonl --rollout vllm --json --output samples.jsonl
"""

ENGINES = tuple(e for e in ROLLOUT_ENGINES if e != "sglang")  # sglang: not wired for eval yet


def _check_sampling(n: int, ks: list[int], temperature: float) -> None:
    from rlctl.errors import UserError

    if n < 1:
        raise UserError(f"--n must be at least 1, got {n}")
    for k in ks:
        if not 1 <= k <= n:
            raise UserError(f"--k {k} must be between 1 and --n ({n}): pass@k draws k of the n samples; raise --n")
    if n > 1 and temperature == 0:
        raise UserError(f"--n {n} with --temperature 0 (greedy) gives {n} identical samples; set --temperature > 0")


def _check_paths(data: str, output: Path | None) -> None:
    from rlctl.data.io import looks_like_hub_name
    from rlctl.errors import UserError

    if not Path(data).expanduser().exists() and not looks_like_hub_name(data):
        raise UserError(f"--data {data}: no such file; pass a JSONL or Parquet file of prompt rows")
    if output is not None and not output.absolute().parent.is_dir():
        raise UserError(f"--output {output}: directory {output.absolute().parent} does not exist; create it first")


def _engine(rollout: str) -> str:
    from rlctl.errors import UserError, did_you_mean

    if rollout not in ENGINES:
        raise UserError(f"--rollout {rollout!r}{did_you_mean(rollout, ENGINES)}: choose one of {', '.join(ENGINES)}")
    return rollout


# run_eval's longer options (their help texts), one name each
_ModelOrRun = Annotated[
    Path,
    typer.Argument(help="A Hugging Face model dir, or a run dir (its hf/ export, else its latest checkpoint)."),
]
_Data = Annotated[
    str,
    typer.Option("--data", help="RL prompt rows (JSONL, Parquet, datasets dir): prompt + answer, or verl's schema."),
]
_Temperature = Annotated[
    float | None, typer.Option("--temperature", help="0 is greedy (default with --n 1; else 1.0).")
]
_MaxNewTokens = Annotated[
    int | None, typer.Option("--max-new-tokens", help="rollout.max_response_len (default: the run's, else 512).")
]
_MaxPromptLen = Annotated[
    int | None, typer.Option("--max-prompt-len", help="Longer prompts are skipped (rollout.max_prompt_len).")
]
_Reward = Annotated[
    list[str] | None,
    typer.Option(
        "--reward", help="Reward spec NAME[:WEIGHT], repeatable (default: the run's, else auto by data_source)."
    ),
]
_Device = Annotated[str | None, typer.Option("--device", help="cpu or cuda (default: cuda when there is one).")]
_Dtype = Annotated[str | None, typer.Option("--dtype", help="fp32 | bf16 | fp16 (default: bf16 on cuda, fp32 on cpu).")]
_Tools = Annotated[
    str | None,
    typer.Option("--tools", help="Multi-turn with tools, as training: FILE.py, FILE.py:a,b or a verl tool YAML."),
]
_Env = Annotated[
    str | None, typer.Option("--env", help="An environment class FILE.py:Class (multi-turn, as training).")
]
_Sets = Annotated[list[str] | None, typer.Option("--set", help="Any config key=value (data.*, reward.*, rollout.*).")]
_Trust = Annotated[
    bool, typer.Option("--trust-checkpoint", help="Unpickle a checkpoint's files fully (see rlctl convert).")
]


def run_eval(
    model_or_run: _ModelOrRun,
    data: _Data,
    n: Annotated[int, typer.Option("--n", help="Samples per prompt.")] = 1,
    k: Annotated[list[int] | None, typer.Option("--k", help="pass@k to report, repeatable (default: 1 and n).")] = None,
    temperature: _Temperature = None,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="-1: off.")] = -1,
    max_new_tokens: _MaxNewTokens = None,
    max_prompt_len: _MaxPromptLen = None,
    reward: _Reward = None,
    prompt_field: Annotated[str | None, typer.Option("--prompt-field")] = None,
    answer_field: Annotated[str | None, typer.Option("--answer-field")] = None,
    system_prompt: Annotated[str | None, typer.Option("--system-prompt")] = None,
    split: Annotated[str | None, typer.Option("--split", help="Split of a datasets dir or hub dataset.")] = None,
    rollout: Annotated[str, typer.Option("--rollout", help="Rollout engine: hf or vllm.")] = "hf",
    device: _Device = None,
    dtype: _Dtype = None,
    tp: Annotated[int, typer.Option("--tp", help="vLLM tensor parallel size.")] = 1,
    mem_fraction: Annotated[float, typer.Option("--mem-fraction", help="vLLM's share of GPU memory.")] = 0.8,
    limit: Annotated[int, typer.Option("--limit", help="Only the first N usable prompts (0: all).")] = 0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    tools: _Tools = None,
    env: _Env = None,
    sets: _Sets = None,
    json_: Annotated[bool, typer.Option("--json", help="Print the summary as one JSON object.")] = False,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="Write one JSON line per sample here.")] = None,
    trust: _Trust = False,
) -> None:
    """Score a model or a run on prompt rows with training's rewards: accuracy, mean reward, pass@k."""
    from rlctl.evaluate.settings import eval_config
    from rlctl.evaluate.source import check_source

    ks, temperature = _sampling(n, k, temperature)
    _check_paths(data, output)
    source = check_source(model_or_run)
    options = {
        "data.path": data,
        "data.split": split,
        "data.prompt_field": prompt_field,
        "data.answer_field": answer_field,
        "data.system_prompt": system_prompt,
        "rollout.max_prompt_len": max_prompt_len,
        "rollout.max_response_len": max_new_tokens,
        "agent.tools": tools,
        "agent.env": env,
        **_reward_option(reward),
    }
    cfg, config_file = eval_config(model_or_run, options, sets or [])
    from rlctl.evaluate.run import EvalSettings, check_rows
    from rlctl.evaluate.settings import load_tools

    check_rows(cfg.data.path, cfg.data.split)
    agent = load_tools(cfg)  # None without --tools / --env
    settings = dict(n=n, ks=tuple(ks), temperature=temperature, top_p=top_p, top_k=top_k, engine=_engine(rollout))
    settings.update(tp=tp, mem_fraction=mem_fraction, limit=limit, seed=seed)
    _run(source, cfg, EvalSettings(**settings), agent, device, dtype, trust, config_file, json_, output)


def _sampling(n: int, k: list[int] | None, temperature: float | None) -> tuple[list[int], float]:
    """The pass@k list (default 1 and n) and the temperature (default greedy for one sample, else 1), checked."""
    if temperature is None:
        temperature = 0.0 if n == 1 else 1.0
    ks = sorted(set(k or [1, n]))
    _check_sampling(n, ks, temperature)
    return ks, temperature


def _reward_option(reward: list[str] | None) -> dict:
    """--reward as the config takes it: one function is reward.fn, several are reward.fns."""
    if not reward:
        return {}
    return {"reward.fn": reward[0]} if len(reward) == 1 else {"reward.fns": reward}


def _run(source, cfg, settings, agent, device, dtype, trust, config_file, json_: bool, output: Path | None) -> None:
    from dataclasses import replace

    from rich.console import Console

    from rlctl.evaluate.run import evaluate, pick_device
    from rlctl.evaluate.source import materialize
    from rlctl.terminal import inert

    err = Console(stderr=True, soft_wrap=True, highlight=False)

    def log(msg: str) -> None:
        err.print(inert(msg), markup=False, style="dim")

    if config_file is not None:
        log(f"data and reward settings from {config_file}")
    device, dtype = pick_device(device, dtype)
    with materialize(source, trust=trust, log=log) as model_dir:
        result = evaluate(model_dir, cfg, replace(settings, device=device, dtype=dtype), agent, log)
    result.metrics = {"model": str(source.path), "data": cfg.data.path, **result.metrics}
    if output is not None:
        with output.open("w") as f:
            for row in result.rows:
                f.write(json.dumps(row, default=str) + "\n")
        log(f"wrote {len(result.rows)} sample rows to {output}")
    if json_:
        typer.echo(json.dumps(result.metrics, default=str))
    else:
        Console().print(_table(result.metrics))


def _table(metrics: dict):
    from rich.table import Table
    from rich.text import Text

    from rlctl.terminal import inert

    title = Text(inert(f"eval: {metrics['model']} on {metrics['data']}"))
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in metrics.items():
        if key in ("model", "data"):
            continue
        shown = f"{value:g}" if key == "temperature" else f"{value:.4f}" if isinstance(value, float) else str(value)
        table.add_row(Text(key), Text(inert(shown)))
    return table
