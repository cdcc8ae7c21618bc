"""Options shared by `rlctl sft`, `rlctl grpo` and `rlctl ppo`, and the code path they share.

Each training command is a thin function in its own module that declares its options with the
Annotated aliases below and hands them to :func:`run_training`. An option left unset (None) does
not override the preset or the config file. No torch import here: --help must stay fast.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from rlctl import names

Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Catalog name (Qwen2.5-7B), HF id, local HF directory or config.json.",
        rich_help_panel="Job",
    ),
]
Data = Annotated[
    str | None,
    typer.Option(
        "--data",
        "-d",
        help="JSONL, Parquet, a directory of Parquet shards, a `datasets` save_to_disk directory, or a hub "
        "dataset name already in the local cache (e.g. openai/gsm8k).",
        rich_help_panel="Job",
    ),
]
ValData = Annotated[
    str | None,
    typer.Option(
        "--val-data",
        help="Validation data (any form --data takes), evaluated every --eval-every steps.",
        rich_help_panel="Evaluation",
    ),
]
ValFraction = Annotated[
    float | None,
    typer.Option(
        "--val-fraction",
        help="Share of --data held out for evaluation (without --val-data).",
        rich_help_panel="Evaluation",
    ),
]
ChatTemplate = Annotated[
    str | None,
    typer.Option(
        "--chat-template",
        help="A Jinja chat template file used instead of the tokenizer's (also saved with the model).",
        rich_help_panel="Job",
    ),
]
SystemPrompt = Annotated[
    str | None,
    typer.Option(
        "--system-prompt",
        help="A system message put before every conversation / prompt that has none (text, or @FILE).",
        rich_help_panel="Job",
    ),
]
Gpus = Annotated[
    int | None,
    typer.Option(
        "--gpus",
        help="GPUs in total across nodes (plan for them even when this machine has none).",
        rich_help_panel="Hardware",
    ),
]
Nodes = Annotated[int | None, typer.Option("--nodes", help="Number of nodes.", rich_help_panel="Hardware")]
Gpu = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        help="GPU type, e.g. H100-80GB, A100-40GB (default: detected, else H100-80GB).",
        rich_help_panel="Hardware",
    ),
]
Device = Annotated[
    str | None, typer.Option("--device", help=f"{names.describe(names.Device)}.", rich_help_panel="Hardware")
]
Nproc = Annotated[
    int | None,
    typer.Option(
        "--nproc", help="Processes per node (default: GPUs per node, or 1 on CPU).", rich_help_panel="Hardware"
    ),
]
NodeRank = Annotated[
    int | None, typer.Option("--node-rank", help="This node's rank (multi-node).", rich_help_panel="Hardware")
]
MasterAddr = Annotated[
    str | None, typer.Option("--master-addr", help="Address of node 0 (multi-node).", rich_help_panel="Hardware")
]
MasterPort = Annotated[
    int | None,
    typer.Option("--master-port", help="Port on node 0 (default: a free one).", rich_help_panel="Hardware"),
]
Rdzv = Annotated[
    str | None,
    typer.Option(
        "--rdzv-endpoint",
        help="host:port of a c10d rendezvous (torchrun's elastic launch).",
        rich_help_panel="Hardware",
    ),
]
Launcher = Annotated[
    str | None, typer.Option("--launcher", help=f"{names.describe(names.Launcher)}.", rich_help_panel="Cluster")
]
Partition = Annotated[
    str | None, typer.Option("--partition", help="SLURM partition (--launcher slurm).", rich_help_panel="Cluster")
]
Account = Annotated[
    str | None, typer.Option("--account", help="SLURM account (--launcher slurm).", rich_help_panel="Cluster")
]
TimeLimit = Annotated[
    str | None,
    typer.Option("--time", help="SLURM time limit, e.g. 04:00:00 (--launcher slurm).", rich_help_panel="Cluster"),
]
Sbatch = Annotated[
    list[str] | None,
    typer.Option(
        "--sbatch",
        help="An extra sbatch option, one #SBATCH line, repeatable (e.g. --sbatch=--qos=high).",
        rich_help_panel="Cluster",
    ),
]
Preset = Annotated[
    str | None,
    typer.Option(
        "--preset",
        help="A named preset applied over the method's defaults (`rlctl presets list`).",
        rich_help_panel="Configuration",
    ),
]
ConfigFile = Annotated[
    str | None,
    typer.Option(
        "--config", "-c", help="YAML file of config sections (overrides the preset).", rich_help_panel="Configuration"
    ),
]
Set = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="key=value with a dotted key, repeatable; wins over everything (e.g. --set train.lr=2e-5).",
        rich_help_panel="Configuration",
    ),
]
OutputDir = Annotated[
    str | None,
    typer.Option(
        "--output-dir",
        "-o",
        help="Run directory (default: runs/<method>-<model>-<time>).",
        rich_help_panel="Configuration",
    ),
]
DryRun = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Print the plan, the resolved config, the memory estimate and the launch command; write nothing.",
        rich_help_panel="Configuration",
    ),
]
Json = Annotated[
    bool, typer.Option("--json", help="With --dry-run: print one JSON object.", rich_help_panel="Configuration")
]

MaxSteps = Annotated[
    int | None,
    typer.Option(
        "--max-steps", help="Stop after this many optimizer steps (0 = run the epochs).", rich_help_panel="Training"
    ),
]
Epochs = Annotated[int | None, typer.Option("--epochs", help="Passes over the data.", rich_help_panel="Training")]
Lr = Annotated[float | None, typer.Option("--lr", help="Peak learning rate.", rich_help_panel="Training")]
MicroBatch = Annotated[
    int | None,
    typer.Option(
        "--micro-batch-size",
        help="Sequences per device per forward.",
        rich_help_panel="Training",
    ),
]
Seed = Annotated[int | None, typer.Option("--seed", help="Random seed.", rich_help_panel="Training")]
SaveEvery = Annotated[
    int | None,
    typer.Option(
        "--save-every",
        help="Checkpoint every N steps and at the end; -1 = auto: every max(50, steps / 10); 0 = only at the end.",
        rich_help_panel="Checkpoints",
    ),
]
KeepLast = Annotated[
    int | None, typer.Option("--keep-last", help="Keep the last K checkpoints.", rich_help_panel="Checkpoints")
]
Resume = Annotated[
    str | None,
    typer.Option(
        "--resume",
        help="auto: the newest intact checkpoint of the run dir (a damaged newer one is passed over and named); "
        "or a checkpoint path (step_N, or a run dir: its latest), which must be intact (else one line names "
        "the damaged file). Every file is checked before launch.",
        rich_help_panel="Checkpoints",
    ),
]
EvalEvery = Annotated[
    int | None,
    typer.Option(
        "--eval-every",
        help="Evaluate the validation data every N steps (0 = only at the end).",
        rich_help_panel="Evaluation",
    ),
]
_EVAL_BEFORE_HELP = "Also evaluate before the first step (step 0): a baseline for the curves (needs validation data)."
EvalBefore = Annotated[bool | None, typer.Option(help=_EVAL_BEFORE_HELP, rich_help_panel="Evaluation")]
Warmup = Annotated[
    float | None,
    typer.Option("--warmup-ratio", help="Share of the steps with a linear lr warmup.", rich_help_panel="Training"),
]
WeightDecay = Annotated[
    float | None, typer.Option("--weight-decay", help="AdamW weight decay.", rich_help_panel="Training")
]
LrScheduler = Annotated[
    str | None, typer.Option("--lr-scheduler", help=f"{names.describe(names.LrScheduler)}.", rich_help_panel="Training")
]
GradCkpt = Annotated[
    bool | None,
    typer.Option(
        "--gradient-checkpointing/--no-gradient-checkpointing",
        help="Recompute activations in the backward pass (default: the plan decides).",
        rich_help_panel="Training",
        show_default=False,
    ),
]
RunName = Annotated[
    str | None,
    typer.Option(
        "--run-name",
        help="Name of the run in W&B / TensorBoard (default: the run directory's).",
        rich_help_panel="Training",
    ),
]
LoraRank = Annotated[
    int | None, typer.Option("--lora-rank", help="LoRA rank (0 = full fine-tuning).", rich_help_panel="LoRA")
]
LoraAlpha = Annotated[float | None, typer.Option("--lora-alpha", help="LoRA alpha.", rich_help_panel="LoRA")]
LoraTargets = Annotated[
    str | None,
    typer.Option("--lora-targets", help="all-linear or a comma list of module names.", rich_help_panel="LoRA"),
]
LoraDropout = Annotated[float | None, typer.Option("--lora-dropout", help="LoRA dropout.", rich_help_panel="LoRA")]
Log = Annotated[
    str | None,
    typer.Option("--log", help=f"Comma list of {names.describe(names.LogBackend)}.", rich_help_panel="Training"),
]


TrustRemoteCode = Annotated[
    bool | None,
    typer.Option(
        "--trust-remote-code",
        help="Run the model's own Python code (config.json auto_map); never implied.",
        rich_help_panel="Job",
    ),
]
IgnoreMemoryCheck = Annotated[
    bool,
    typer.Option(
        "--ignore-memory-check",
        help="Launch even when the planner says the job does not fit in GPU memory.",
        rich_help_panel="Configuration",
    ),
]


# option (parameter name) -> config key, for every training command; the command adds its own
COMMON_KEYS = {
    "model": "model.name",
    "data": "data.path",
    "val_data": "data.val_path",
    "val_fraction": "data.val_fraction",
    "system_prompt": "data.system_prompt",
    "chat_template": "data.chat_template",
    "gpus": "hardware.gpus",
    "nodes": "hardware.nodes",
    "gpu": "hardware.gpu",
    "device": "hardware.device",
    "nproc": "hardware.nproc",
    "node_rank": "hardware.node_rank",
    "master_addr": "hardware.master_addr",
    "master_port": "hardware.master_port",
    "rdzv_endpoint": "hardware.rdzv_endpoint",
    "launcher": "cluster.launcher",
    "partition": "cluster.partition",
    "account": "cluster.account",
    "time_limit": "cluster.time",
    "sbatch": "cluster.sbatch",
    "output_dir": "output_dir",
    "max_steps": "train.max_steps",
    "epochs": "train.epochs",
    "lr": "train.lr",
    "warmup_ratio": "train.warmup_ratio",
    "weight_decay": "train.weight_decay",
    "lr_scheduler": "train.lr_scheduler",
    "batch_size": "train.batch_size",
    "micro_batch_size": "train.micro_batch_size",
    "eval_every": "train.eval_every",
    "eval_before": "train.eval_before",
    "save_every": "checkpoint.save_every",
    "keep_last": "checkpoint.keep_last",
    "resume": "checkpoint.resume",
    "seed": "train.seed",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_targets": "lora.targets",
    "lora_dropout": "lora.dropout",
    "log": "log.backends",
    "run_name": "log.run_name",
}
# shown instead of the raw default where the raw value means "decided elsewhere"
SHOWN = {
    "train.micro_batch_size": "from the plan",
    "train.max_steps": "0: the epochs",
    "checkpoint.save_every": "-1: auto",
    "lora.alpha": "2 x rank",
}


def to_mapping(values: dict, keys: dict[str, str]) -> dict[str, object]:
    """The CLI layer of the config: {config key: value} for every option given (None = not given)."""
    out = {
        key: values.get(param) or (None if values.get(param) == [] else values.get(param))
        for param, key in keys.items()
    }
    if values.get("trust_remote_code"):
        out["model.trust_remote_code"] = True
    ckpt = values.get("gradient_checkpointing")
    if ckpt is not None:
        out["parallel.activation_checkpointing"] = ckpt
    prompt = out.get("data.system_prompt")
    if isinstance(prompt, str) and prompt.startswith("@"):
        from pathlib import Path

        from rlctl.errors import UserError

        path = Path(prompt[1:]).expanduser()
        if not path.is_file():
            raise UserError(f"--system-prompt {prompt}: no such file (give the text, or @FILE of an existing file)")
        out["data.system_prompt"] = path.read_text().strip()
    return out


def show_defaults(command, method: str, keys: dict[str, str]):
    """Put each option's default (the method's preset over the config defaults) into its --help, as
    bench does: the options default to None (not given), so typer alone would show nothing."""
    import copy
    import typing

    from rlctl.config import build_config, get_key
    from rlctl.presets import method_layers

    cfg = build_config(method, method_layers(method, None))
    hints = typing.get_type_hints(command, include_extras=True)
    for param, key in keys.items():
        hint = hints.get(param)
        if typing.get_origin(hint) is not Annotated:
            continue
        base, *meta = typing.get_args(hint)
        info = copy.copy(meta[0])
        value = SHOWN.get(key, get_key(cfg, key))
        if value in ("", None, []) or info.show_default is False or key.split(".")[0] in ("hardware", "model"):
            continue
        info.help = f"{info.help} (default: {value})"
        command.__annotations__[param] = Annotated[base, info]
    return command


def run_training(
    method: str,
    *,
    preset,
    config_file,
    options: dict,
    sets,
    dry_run: bool,
    as_json: bool,
    ignore_memory_check: bool = False,
) -> None:
    """The body of `rlctl sft|grpo|ppo`: resolve and check the job (:mod:`rlctl.job`), then either print
    it (--dry-run) or launch it."""
    import importlib.util
    import os

    from rlctl.errors import NotAvailableYet, UserError
    from rlctl.job import check_dry_run, check_job, resolve_job, with_run_dir
    from rlctl.launch import build_command, default_run_dir
    from rlctl.slurm import allocation_options

    options = allocation_options(options, os.environ)  # inside a SLURM allocation: this node's place
    cfg, plan = resolve_job(method, preset=preset, config_file=config_file, options=options, sets=sets)
    if plan.nodes > 1 and plan.rollout in ("vllm", "sglang") and plan.rollout_tp > 1:
        from rlctl.runtime.dist import check_rollout_in_node  # (imports torch: only for multi-node RL)

        check_rollout_in_node(plan.rollout_tp, plan.nproc_per_node)
    if cfg.cluster.launcher == "slurm":
        return submit_slurm(cfg, plan, dry_run=dry_run, as_json=as_json, ignore_memory_check=ignore_memory_check)
    if plan.nodes > 1 and not cfg.output_dir and not os.environ.get("SLURM_JOB_ID") and not dry_run:
        raise UserError(
            f"a run on {plan.nodes} nodes needs --output-dir: the same run directory on every node, "
            f"on a filesystem all nodes share"
        )
    if dry_run:
        check_dry_run(cfg)
        run_dir = cfg.output_dir or str(default_run_dir(cfg))
        argv = build_command(cfg, plan, run_dir)
        if as_json:
            doc = {"plan": plan.to_dict(), "config": cfg.to_dict(), "launch": argv, "estimate": plan.estimate.to_dict()}
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        else:
            print_dry_run(cfg, plan, argv)
        return
    if as_json:
        raise UserError("--json goes with --dry-run (a real run writes metrics.jsonl in its run directory)")
    cfg = with_run_dir(cfg)
    check_job(cfg, plan, ignore_memory_check=ignore_memory_check)
    if importlib.util.find_spec(f"rlctl.recipes.{method}") is None:
        raise NotAvailableYet(
            f"`rlctl {method}` is not available yet (its training recipe has not landed); --dry-run works"
        )
    from rlctl.launch import launch_job

    raise typer.Exit(launch_job(cfg, plan))


def submit_slurm(cfg, plan, *, dry_run: bool, as_json: bool, ignore_memory_check: bool) -> None:
    """--launcher slurm: print the sbatch script (--dry-run), or write it with the job and submit it."""
    from pathlib import Path

    from rlctl.errors import UserError
    from rlctl.job import check_dry_run, check_job, with_run_dir
    from rlctl.launch import default_run_dir
    from rlctl.slurm import sbatch_script, submit, write_job

    if dry_run:
        check_dry_run(cfg)
        run_dir = Path(cfg.output_dir or default_run_dir(cfg)).absolute()
        script = sbatch_script(cfg, plan, run_dir)
        if as_json:
            sys.stdout.write(json.dumps({"plan": plan.to_dict(), "config": cfg.to_dict(), "sbatch": script}) + "\n")
        else:
            sys.stdout.write(script)
        return
    if as_json:
        raise UserError("--json goes with --dry-run (a real run writes metrics.jsonl in its run directory)")
    cfg = with_run_dir(cfg)
    check_job(cfg, plan, ignore_memory_check=ignore_memory_check, on_this_machine=False)
    run_dir = Path(cfg.output_dir)
    script = write_job(cfg, plan, run_dir)
    job = submit(script)
    per_node = f"{plan.nproc_per_node} GPUs" if plan.device == "cuda" else f"{plan.nproc_per_node} processes"
    print(f"submitted batch job {job}: {plan.nodes} nodes x {per_node}; script: {script}")
    print(f"logs: {run_dir / f'slurm-{job}.out'} (SLURM), {run_dir / 'train.log'} (the ranks)")
    print(f"follow it: squeue -j {job}; tail -f {run_dir / 'train.log'}")


def print_dry_run(cfg, plan, argv: list[str]) -> None:
    import shlex

    import yaml
    from rich.console import Console
    from rich.panel import Panel
    from rich.syntax import Syntax

    from rlctl.estimate.render import render_estimate
    from rlctl.plan.render import render_plan

    console = Console()
    render_plan(console, plan)
    console.print(
        Panel(
            Syntax(yaml.safe_dump(cfg.to_dict(), sort_keys=False), "yaml"), title="resolved configuration", expand=False
        )
    )
    render_estimate(console, plan.estimate)
    console.print(
        Panel(
            " ".join(shlex.quote(a) for a in argv), title="launch command (dry run: nothing was written)", expand=False
        )
    )
