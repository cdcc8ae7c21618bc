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
    str | None, typer.Option("--data", "-d", help="JSONL, Parquet or a `datasets` directory.", rich_help_panel="Job")
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
Device = Annotated[str | None, typer.Option("--device", help="auto | cuda | cpu.", rich_help_panel="Hardware")]
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
        help="Sequences per device per forward (default: from the plan).",
        rich_help_panel="Training",
    ),
]
Seed = Annotated[int | None, typer.Option("--seed", help="Random seed.", rich_help_panel="Training")]
SaveEvery = Annotated[
    int | None,
    typer.Option(
        "--save-every", help="Checkpoint every N steps (and always at the end).", rich_help_panel="Checkpoints"
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
    int | None, typer.Option("--eval-every", help="Evaluate every N steps (0 = never).", rich_help_panel="Training")
]
LoraRank = Annotated[
    int | None, typer.Option("--lora-rank", help="LoRA rank (0 = full fine-tuning).", rich_help_panel="LoRA")
]
LoraAlpha = Annotated[
    float | None, typer.Option("--lora-alpha", help="LoRA alpha (default 2 x rank).", rich_help_panel="LoRA")
]
LoraTargets = Annotated[
    str | None,
    typer.Option("--lora-targets", help="all-linear or a comma list of module names.", rich_help_panel="LoRA"),
]
Log = Annotated[
    str | None,
    typer.Option("--log", help="Comma list of metric sinks: console, tensorboard, wandb.", rich_help_panel="Training"),
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


def common_mapping(
    *,
    model,
    data,
    gpus,
    nodes,
    gpu,
    device,
    nproc,
    node_rank,
    master_addr,
    master_port,
    rdzv_endpoint,
    output_dir,
    trust_remote_code=None,
) -> dict[str, object]:
    return {
        "model.name": model,
        "model.trust_remote_code": trust_remote_code or None,
        "data.path": data,
        "hardware.gpus": gpus,
        "hardware.nodes": nodes,
        "hardware.gpu": gpu,
        "hardware.device": device,
        "hardware.nproc": nproc,
        "hardware.node_rank": node_rank,
        "hardware.master_addr": master_addr,
        "hardware.master_port": master_port,
        "hardware.rdzv_endpoint": rdzv_endpoint,
        "output_dir": output_dir,
    }


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

    from rlctl.errors import NotAvailableYet, UserError
    from rlctl.job import check_job, resolve_job, with_run_dir
    from rlctl.launch import build_command, default_run_dir

    cfg, plan = resolve_job(method, preset=preset, config_file=config_file, options=options, sets=sets)
    if dry_run:
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
