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


KEYS = {
    **o.COMMON_KEYS,
    "max_len": "train.max_len",
    "packing": "data.packing",
}


def sft(
    model: o.Model = None,
    data: o.Data = None,
    val_data: o.ValData = None,
    val_fraction: o.ValFraction = None,
    eval_every: o.EvalEvery = None,
    eval_before: o.EvalBefore = None,
    system_prompt: o.SystemPrompt = None,
    chat_template: o.ChatTemplate = None,
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
    lr_scheduler: o.LrScheduler = None,
    warmup_ratio: o.Warmup = None,
    weight_decay: o.WeightDecay = None,
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
        typer.Option("--packing/--no-packing", help="Pack several documents per row.", rich_help_panel="Training"),
    ] = None,
    gradient_checkpointing: o.GradCkpt = None,
    save_every: o.SaveEvery = None,
    keep_last: o.KeepLast = None,
    resume: o.Resume = None,
    seed: o.Seed = None,
    lora_rank: o.LoraRank = None,
    lora_alpha: o.LoraAlpha = None,
    lora_targets: o.LoraTargets = None,
    lora_dropout: o.LoraDropout = None,
    log: o.Log = None,
    run_name: o.RunName = None,
    trust_remote_code: o.TrustRemoteCode = None,
    ignore_memory_check: o.IgnoreMemoryCheck = False,
) -> None:
    """Supervised fine-tuning: packed sequences, loss on assistant tokens, LoRA or full, exact resume."""
    o.run_training(
        "sft",
        preset=preset,
        config_file=config,
        options=o.to_mapping(locals(), KEYS),
        sets=set_,
        dry_run=dry_run,
        as_json=json_,
        ignore_memory_check=ignore_memory_check,
    )


o.show_defaults(sft, "sft", KEYS)
