"""`rlctl estimate memory`: per-GPU memory of a whole job (trainer and rollout engine together),
with the plan rlctl would run, before anything is rented or launched.

The configuration is built the way `rlctl sft|grpo|ppo` build it (the method's preset, then these
options), so every setting left out comes from the same plan. No torch import on this path.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from rlctl import names
from rlctl.names import describe

EXAMPLES = """
Examples:

  rlctl estimate memory --model Qwen2.5-7B --method grpo --gpus 8 --gpu H100-80GB

  rlctl estimate memory --model Qwen2.5-7B --method grpo --lora-rank 32 --gpus 1 --what-to-rent

  rlctl estimate memory --model Qwen2.5-72B --method sft --gpus 16 --nodes 2 --max-len 4096 --json

  rlctl estimate memory --model Qwen2.5-72B --method sft --gpus 8 --gpu H100-80GB --host-memory 1024

  rlctl estimate memory --model Qwen2.5-32B --backend megatron --tp 4 --rollout vllm --rollout-tp 2 --mem-fraction 0.5

  rlctl estimate memory --model Llama-3.1-8B --method sft --gpus 1 --gpu RTX-4090 --lora-rank 8 --precision bf16
      --no-shard --loss-chunk 512
"""

app = typer.Typer(
    help="Estimate memory before you run: trainer and rollout engine, per GPU, with the plan.",
    epilog=EXAMPLES,
    no_args_is_help=True,
)

JOB, HW, PAR, RO = "Job", "Hardware", "Parallelism", "Rollout"


@app.callback()
def _group() -> None:
    """Estimate memory before you run: trainer and rollout engine, per GPU, with the plan."""


def _alias(name: str, value: int | None, old: str, old_value: int | None) -> int | None:
    """The value of an option given by its name or by its old (hidden) one; both, if they differ, is an error."""
    if old_value is None:
        return value
    if value is not None and value != old_value:
        from rlctl.errors import UserError

        raise UserError(f"{name} {value} and {old} {old_value} disagree: {old} is the old name of {name}; give one")
    return old_value


def _with_loss_chunk(plan, chunk: int):
    """The plan's layout estimated again with a chunked loss (the config has no key for it yet)."""
    from dataclasses import replace

    from rlctl.catalog import resolve_gpu, resolve_model
    from rlctl.errors import UserError
    from rlctl.estimate.memory import estimate_memory

    if chunk < 0:
        raise UserError(f"--loss-chunk {chunk}: give the tokens per chunk (e.g. 1024), or leave it out")
    est = plan.estimate
    gpu = resolve_gpu(est.gpu) if plan.device == "cuda" else None
    if gpu is None:
        return plan
    est = estimate_memory(resolve_model(plan.model), gpu, replace(est.settings, loss_chunk=chunk))
    return replace(plan, estimate=est, fits=est.fits)


@app.command("memory", epilog=EXAMPLES)
def memory(
    model: Annotated[
        str,
        typer.Option(
            "--model",
            "-m",
            help="Catalog name (Qwen2.5-7B), HF id, local HF directory or config.json.",
            rich_help_panel=JOB,
        ),
    ],
    method: Annotated[str, typer.Option("--method", help=f"{describe(names.Method)}.", rich_help_panel=JOB)] = "grpo",
    lora_rank: Annotated[
        int | None, typer.Option("--lora-rank", help="LoRA rank (0 = full fine-tuning).", rich_help_panel=JOB)
    ] = None,
    lora_targets: Annotated[
        str | None,
        typer.Option("--lora-targets", help="all-linear or a comma list such as q_proj,v_proj.", rich_help_panel=JOB),
    ] = None,
    max_len: Annotated[int | None, typer.Option("--max-len", help="SFT sequence length.", rich_help_panel=JOB)] = None,
    max_prompt_len: Annotated[
        int | None, typer.Option("--max-prompt-len", help="RL: longest prompt in tokens.", rich_help_panel=JOB)
    ] = None,
    max_response_len: Annotated[
        int | None,
        typer.Option("--max-response-len", help="RL: most tokens generated per sample.", rich_help_panel=JOB),
    ] = None,
    n: Annotated[int | None, typer.Option("--n", help="RL: samples per prompt.", rich_help_panel=JOB)] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", help="Sequences (SFT) or prompts (RL) per step.", rich_help_panel=JOB),
    ] = None,
    micro_batch_size: Annotated[
        int | None,
        typer.Option(
            "--micro-batch-size", help="Sequences per GPU per forward (default: the plan's).", rich_help_panel=JOB
        ),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option("--gpus", help="GPUs in total (default: the local ones, else one full node).", rich_help_panel=HW),
    ] = None,
    nodes: Annotated[int | None, typer.Option("--nodes", help="Number of nodes.", rich_help_panel=HW)] = None,
    gpu: Annotated[
        str | None,
        typer.Option("--gpu", help="GPU type, e.g. H100-80GB (default: detected, else H100-80GB).", rich_help_panel=HW),
    ] = None,
    device: Annotated[
        str | None,
        typer.Option(
            "--device",
            help=f"{describe(names.Device, without=('auto',))} (default cuda: estimates are for GPUs).",
            rich_help_panel=HW,
        ),
    ] = None,
    host_memory: Annotated[
        float | None,
        typer.Option(
            "--host-memory",
            help="Host (CPU) memory of one node in GiB (default: the GPU type's typical node, "
            "shared by the GPUs used on it).",
            rich_help_panel=HW,
        ),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option("--backend", help=f"{describe(names.Backend, without=('auto',))}.", rich_help_panel=PAR),
    ] = None,
    tp: Annotated[int | None, typer.Option("--tp", help="Megatron tensor-parallel size.", rich_help_panel=PAR)] = None,
    pp: Annotated[int | None, typer.Option("--pp", help="Megatron pipeline stages.", rich_help_panel=PAR)] = None,
    ep: Annotated[
        int | None, typer.Option("--ep", help="Megatron expert parallelism (MoE).", rich_help_panel=PAR)
    ] = None,
    cp: Annotated[
        int | None,
        typer.Option("--cp", help="Context parallelism (Megatron; the FSDP engine has none).", rich_help_panel=PAR),
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(
            "--precision",
            help=f"{describe(names.Precision)}.",
            rich_help_panel=PAR,
        ),
    ] = None,
    selective_checkpointing: Annotated[
        bool | None,
        typer.Option(
            "--selective-checkpointing/--no-selective-checkpointing",
            help="FSDP: recompute the MLPs only (default: the plan's).",
            rich_help_panel=PAR,
        ),
    ] = None,
    offload_activations: Annotated[
        bool | None,
        typer.Option(
            "--offload-activations/--no-offload-activations",
            help="FSDP: keep saved activations in pinned host memory (default: the plan's).",
            rich_help_panel=PAR,
        ),
    ] = None,
    shard: Annotated[
        bool | None,
        typer.Option(
            "--shard/--no-shard",
            help="FSDP wrappers; --no-shard on one GPU: the plain module, no gather buffers (default: the plan's).",
            rich_help_panel=PAR,
        ),
    ] = None,
    max_tokens_per_micro_batch: Annotated[
        int | None,
        typer.Option(
            "--max-tokens-per-micro-batch",
            help="Packed micro batches by token budget per GPU (verl's dynamic batch size).",
            rich_help_panel=JOB,
        ),
    ] = None,
    loss_chunk: Annotated[
        int | None,
        typer.Option(
            "--loss-chunk",
            help="Tokens per chunk of the loss (chunked log-softmax; RL: logits at response positions only).",
            rich_help_panel=JOB,
        ),
    ] = None,
    kl_coef: Annotated[
        float | None,
        typer.Option("--kl-coef", help="RL: KL coefficient; 0 = no reference model.", rich_help_panel=JOB),
    ] = None,
    reward_model: Annotated[
        str | None,
        typer.Option("--reward-model", help="RL: a reward model on the training GPUs.", rich_help_panel=JOB),
    ] = None,
    activation_checkpointing: Annotated[
        bool | None,
        typer.Option(
            "--activation-checkpointing/--no-activation-checkpointing",
            help="Force checkpointing on or off (default: the plan's).",
            rich_help_panel=PAR,
        ),
    ] = None,
    offload_params: Annotated[
        bool | None,
        typer.Option(
            "--offload-params/--no-offload-params",
            help="Move the trainer's weights to CPU between phases.",
            rich_help_panel=PAR,
        ),
    ] = None,
    offload_optimizer: Annotated[
        bool | None,
        typer.Option(
            "--offload-optimizer/--no-offload-optimizer",
            help="Move the optimizer states to CPU between phases.",
            rich_help_panel=PAR,
        ),
    ] = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help=f"{describe(names.Dtype, without=('auto',))}.", rich_help_panel=PAR)
    ] = None,
    rollout: Annotated[
        str | None,
        typer.Option("--rollout", help=f"{describe(names.RolloutEngine, without=('auto',))}.", rich_help_panel=RO),
    ] = None,
    rollout_tp: Annotated[
        int | None,
        typer.Option("--rollout-tp", help="Tensor parallelism of the rollout engine.", rich_help_panel=RO),
    ] = None,
    mem_fraction: Annotated[
        float | None,
        typer.Option(
            "--mem-fraction", help="vLLM gpu_memory_utilization / SGLang mem_fraction_static.", rich_help_panel=RO
        ),
    ] = None,
    what_to_rent: Annotated[
        bool,
        typer.Option(
            "--what-to-rent",
            help="Also list, for every catalog GPU type, the fewest GPUs that fit without and with offload, "
            "and their plans.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    prompt_len: Annotated[int | None, typer.Option("--prompt-len", hidden=True)] = None,  # old --max-prompt-len
    response_len: Annotated[int | None, typer.Option("--response-len", hidden=True)] = None,  # old --max-response-len
    micro_batch: Annotated[int | None, typer.Option("--micro-batch", hidden=True)] = None,  # old --micro-batch-size
) -> None:
    """Per-GPU memory of the training and rollout phases, the KV cache, and whether it fits."""
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.errors import UserError
    from rlctl.plan import detect_local, resolve_plan
    from rlctl.presets import method_layers

    if host_memory is not None and host_memory <= 0:
        raise UserError(
            f"--host-memory {host_memory:g}: give the host memory of one node in GiB, e.g. --host-memory 1024"
        )
    if gpus is not None and gpus < 1:
        raise UserError(f"--gpus {gpus}: give the number of GPUs (at least 1), or --device cpu for a CPU run")
    prompt_len = _alias("--max-prompt-len", max_prompt_len, "--prompt-len", prompt_len)
    response_len = _alias("--max-response-len", max_response_len, "--response-len", response_len)
    micro_batch = _alias("--micro-batch-size", micro_batch_size, "--micro-batch", micro_batch)
    host_bytes = int((host_memory or 0) * 2**30)
    if device is None and not gpus and detect_local().gpu_count == 0:
        device = "cuda"  # an estimate is for GPUs, even printed on a laptop
    options = {
        "model.name": model,
        "lora.rank": lora_rank,
        "lora.targets": lora_targets,
        "train.max_len": max_len,
        "rollout.max_prompt_len": prompt_len,
        "rollout.max_response_len": response_len,
        "rollout.n": n,
        "train.batch_size": batch_size,
        "train.micro_batch_size": micro_batch,
        "hardware.gpus": gpus,
        "hardware.nodes": nodes,
        "hardware.gpu": gpu,
        "hardware.device": device,
        "parallel.backend": backend,
        "parallel.tp": tp,
        "parallel.pp": pp,
        "parallel.ep": ep,
        "parallel.cp": cp,
        "train.precision": precision,
        "parallel.selective_checkpointing": selective_checkpointing,
        "parallel.offload_activations": offload_activations,
        "parallel.shard": shard,
        "train.max_tokens_per_micro_batch": max_tokens_per_micro_batch,
        "algo.kl_coef": kl_coef,
        "reward.model": reward_model,
        "parallel.activation_checkpointing": activation_checkpointing,
        "parallel.offload_params": offload_params,
        "parallel.offload_optimizer": offload_optimizer,
        "model.dtype": dtype,
        "rollout.engine": rollout,
        "rollout.tp": rollout_tp,
        "rollout.mem_fraction": mem_fraction,
    }
    layer = dotted_to_nested({k: v for k, v in options.items() if v is not None})
    cfg = build_config(method, method_layers(method, None) + [layer])
    plan = resolve_plan(cfg, host_memory_bytes=host_bytes)
    if loss_chunk:
        plan = _with_loss_chunk(plan, loss_chunk)
    rows = []
    if what_to_rent:
        from rlctl.plan import what_to_rent as rent

        rows = rent(cfg, host_memory_bytes=host_bytes)
    if as_json:
        doc = plan.estimate.to_dict()
        doc["plan"] = {k: v for k, v in plan.to_dict().items() if k != "estimate"}
        if what_to_rent:
            doc["what_to_rent"] = [row.to_dict() for row in rows]
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    from rich.console import Console

    from rlctl.plan.render import render_estimate, render_plan, render_what_to_rent

    console = Console()
    render_plan(console, plan)
    render_estimate(console, plan.estimate)
    if what_to_rent:
        render_what_to_rent(console, rows)
