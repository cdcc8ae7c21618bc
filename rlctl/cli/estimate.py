"""`rlctl estimate memory`: per-GPU memory of a whole job (trainer and rollout engine together),
with the plan rlctl would run, before anything is rented or launched.

The options are the training commands' (one table: :mod:`rlctl.cli.flags`) and the job is resolved by
:func:`rlctl.job.resolve_job`, as `rlctl sft|grpo|ppo` resolve it, so every setting left out comes from
the same plan. No torch import on this path.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer

from rlctl.cli.flags import ESTIMATE
from rlctl.cli.help import FlagsCommand
from rlctl.cli.options import command, to_options

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


@app.callback()
def _group() -> None:
    """Estimate memory before you run: trainer and rollout engine, per GPU, with the plan."""


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


def run_estimate(v: dict[str, Any]) -> None:
    """Per-GPU memory of the training and rollout phases, the KV cache, and whether it fits."""
    from rlctl.errors import UserError
    from rlctl.job import resolve_job
    from rlctl.plan import detect_local

    if v["host_memory"] is not None and v["host_memory"] <= 0:
        raise UserError(
            f"--host-memory {v['host_memory']:g}: give the host memory of one node in GiB, e.g. --host-memory 1024"
        )
    if v["gpus"] is not None and v["gpus"] < 1:
        raise UserError(f"--gpus {v['gpus']}: give the number of GPUs (at least 1), or --device cpu for a CPU run")
    if not (v["model"] or v["config_file"] or any(x.startswith("model.name=") for x in v["sets"] or [])):
        raise UserError(
            f"no model given: pass --model, e.g. `rlctl estimate memory --model Qwen2.5-7B --method {v['method']}`"
        )
    on_gpus = v["device"] is None and not v["gpus"] and detect_local().gpu_count == 0
    job = resolve_job(
        v["method"],
        preset=v["preset"],
        config_file=v["config_file"],
        options=to_options(v, ESTIMATE),
        sets=v["sets"],
        defaults={"hardware.device": "cuda"} if on_gpus else None,  # an estimate is for GPUs, even on a laptop
        measure_data=True,  # sft / dpo: the logits at the data's labelled share of positions
    )
    plan = _with_loss_chunk(job.plan, v["loss_chunk"]) if v["loss_chunk"] else job.plan
    rows = None
    if v["what_to_rent"]:
        from rlctl.plan import what_to_rent

        rows = what_to_rent(job.requested)
    if v["as_json"]:
        doc = plan.estimate.to_dict()
        doc["plan"] = {k: val for k, val in plan.to_dict().items() if k != "estimate"}
        if rows is not None:
            doc["what_to_rent"] = [row.to_dict() for row in rows]
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    from rich.console import Console

    from rlctl.plan.render import render_estimate, render_plan, render_what_to_rent

    console = Console()
    render_plan(console, plan)
    render_estimate(console, plan.estimate)
    if rows is not None:
        render_what_to_rent(console, rows)


memory = app.command("memory", epilog=EXAMPLES, cls=FlagsCommand)(
    command(ESTIMATE, run_estimate, doc=run_estimate.__doc__ or "", defaults_of=None)
)
