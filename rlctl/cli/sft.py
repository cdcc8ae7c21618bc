"""`rlctl sft`: supervised fine-tuning on FSDP2 under torchrun."""

from __future__ import annotations

from typing import Annotated

import typer

from rlctl.cli import options as o

EXAMPLES = """
Examples:

  rlctl sft --model Qwen2.5-7B --data chats.jsonl --gpus 8 --dry-run

  rlctl sft --model Qwen2.5-1.5B --data chats.jsonl --gpus 2 --lora-rank 16 --max-steps 500

  rlctl sft --model ./my-model --data data.parquet --device cpu --nproc 2 --max-len 512

  rlctl sft --config run.yaml --set train.lr=2e-5 --resume auto -o runs/my-sft
"""


def sft(
    model: o.Model = None,
    data: o.Data = None,
    gpus: o.Gpus = None,
    nodes: o.Nodes = None,
    gpu: o.Gpu = None,
    device: o.Device = None,
    nproc: o.Nproc = None,
    node_rank: o.NodeRank = None,
    master_addr: o.MasterAddr = None,
    master_port: o.MasterPort = None,
    rdzv_endpoint: o.Rdzv = None,
    launcher: o.Launcher = None,
    partition: o.Partition = None,
    account: o.Account = None,
    time_limit: o.TimeLimit = None,
    sbatch: o.Sbatch = None,
    preset: o.Preset = None,
    config: o.ConfigFile = None,
    set_: o.Set = None,
    output_dir: o.OutputDir = None,
    dry_run: o.DryRun = False,
    json_: o.Json = False,
    max_steps: o.MaxSteps = None,
    epochs: o.Epochs = None,
    lr: o.Lr = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", help="Sequences per optimizer step (global).", rich_help_panel="Training"),
    ] = None,
    micro_batch_size: o.MicroBatch = None,
    max_len: Annotated[
        int | None,
        typer.Option(
            "--max-len",
            help="Longest sequence in tokens (also the packing budget per sequence slot).",
            rich_help_panel="Training",
        ),
    ] = None,
    packing: Annotated[
        bool | None,
        typer.Option(
            "--packing/--no-packing", help="Pack several documents per row (default on).", rich_help_panel="Training"
        ),
    ] = None,
    val_fraction: Annotated[
        float | None,
        typer.Option("--val-fraction", help="Share of the data held out for eval loss.", rich_help_panel="Training"),
    ] = None,
    eval_every: o.EvalEvery = None,
    save_every: o.SaveEvery = None,
    keep_last: o.KeepLast = None,
    resume: o.Resume = None,
    seed: o.Seed = None,
    lora_rank: o.LoraRank = None,
    lora_alpha: o.LoraAlpha = None,
    lora_targets: o.LoraTargets = None,
    log: o.Log = None,
    trust_remote_code: o.TrustRemoteCode = None,
    ignore_memory_check: o.IgnoreMemoryCheck = False,
) -> None:
    """Supervised fine-tuning: packed sequences, loss on assistant tokens, LoRA or full, exact resume."""
    mapping = o.common_mapping(
        model=model,
        data=data,
        gpus=gpus,
        nodes=nodes,
        gpu=gpu,
        device=device,
        nproc=nproc,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_endpoint=rdzv_endpoint,
        launcher=launcher,
        partition=partition,
        account=account,
        time=time_limit,
        sbatch=sbatch,
        output_dir=output_dir,
        trust_remote_code=trust_remote_code,
    )
    mapping.update(
        {
            "train.max_steps": max_steps,
            "train.epochs": epochs,
            "train.lr": lr,
            "train.batch_size": batch_size,
            "train.micro_batch_size": micro_batch_size,
            "train.max_len": max_len,
            "data.packing": packing,
            "data.val_fraction": val_fraction,
            "train.eval_every": eval_every,
            "checkpoint.save_every": save_every,
            "checkpoint.keep_last": keep_last,
            "checkpoint.resume": resume,
            "train.seed": seed,
            "lora.rank": lora_rank,
            "lora.alpha": lora_alpha,
            "lora.targets": lora_targets,
            "log.backends": log,
        }
    )
    o.run_training(
        "sft",
        preset=preset,
        config_file=config,
        options=mapping,
        sets=set_,
        dry_run=dry_run,
        as_json=json_,
        ignore_memory_check=ignore_memory_check,
    )
