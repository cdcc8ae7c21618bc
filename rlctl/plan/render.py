"""Rich rendering of plans, estimates and what-to-rent rows."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlctl.estimate.memory import GIB
from rlctl.estimate.render import render_estimate
from rlctl.plan.advice import RentRow
from rlctl.plan.types import Plan

__all__ = ["render_estimate", "render_plan", "render_what_to_rent"]


def _layout(plan: Plan) -> str:
    if plan.backend == "fsdp":
        return f"fsdp, dp {plan.dp}" + (f" x sp {plan.sp} (Ulysses)" if plan.sp > 1 else "")
    parts = [f"tp {plan.tp}", f"pp {plan.pp}", f"dp {plan.dp}"]
    if plan.ep > 1:
        parts.append(f"ep {plan.ep}")
    if plan.cp > 1:
        parts.append(f"cp {plan.cp}")
    return "megatron, " + " x ".join(parts) + (", SP" if plan.sequence_parallel else "")


def engine_wrapper(plan: Plan) -> str:
    """What wraps the model on each rank: what a run of the plan exercises (one GPU: FSDP2 only with
    parallel.shard, else the plain module)."""
    if plan.backend == "megatron":
        return "Megatron-core (its DDP and distributed optimizer)"
    if not plan.shard:
        return "plain module, no FSDP (--shard: FSDP2)"
    offload = " + CPUOffloadPolicy" if plan.offload_params or plan.offload_optimizer else ""
    return f"FSDP2 fully_shard over {plan.dp * plan.sp} rank{'s' if plan.dp * plan.sp > 1 else ''}{offload}"


def _rollout(plan: Plan) -> str:
    if plan.rollout is None:
        return "-"
    frac = f", memory fraction {plan.rollout_mem_fraction:.2f}" if plan.rollout_mem_fraction else ""
    return f"{plan.rollout}, tp {plan.rollout_tp}{frac}"


def _offload(plan: Plan) -> str:
    parts = [name for name, on in (("params", plan.offload_params), ("optim", plan.offload_optimizer)) if on]
    return "+".join(parts) or "none"


def render_plan(console: Console, plan: Plan) -> None:
    """The plan's choices, the reasons behind them, and warnings."""
    table = Table(title=f"plan: rlctl {plan.method} {plan.model}", title_justify="left", show_header=False)
    table.add_column("setting", style="bold")
    table.add_column("value")
    hardware = (
        f"{plan.gpus} x {plan.gpu} ({plan.nodes} node{'s' if plan.nodes > 1 else ''}, {plan.nproc_per_node} per node)"
        if plan.device == "cuda"
        else f"cpu, {plan.nproc_per_node} process(es) x {plan.nodes} node(s)"
    )
    rows = [
        ("hardware", hardware),
        (
            "training",
            f"{_layout(plan)}; {'LoRA rank ' + str(plan.lora_rank) if plan.lora_rank else 'full fine-tuning'}",
        ),
        ("engine wrapper", engine_wrapper(plan)),
        ("rollout", _rollout(plan)),
        ("micro batch", str(plan.micro_batch_size)),
        ("activation checkpointing", _checkpointing(plan)),
        ("offload", _offload(plan)),
        ("dtype / attention", f"{plan.dtype} / {plan.attn}"),
        ("fits", "[green]yes[/green]" if plan.fits else "[red]no[/red]"),
    ]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    console.print("[bold]why:[/bold]")
    for reason in plan.reasons:
        console.print(f"  - {escape(reason)}", highlight=False)
    for warning in plan.warnings:
        console.print(f"[yellow]warning: {escape(warning)}[/yellow]", highlight=False)


def _short_layout(plan: Plan) -> str:
    if plan.backend == "fsdp":
        return f"fsdp dp{plan.dp}" + (f" sp{plan.sp}" if plan.sp > 1 else "")
    return f"megatron tp{plan.tp} pp{plan.pp} dp{plan.dp}" + (f" ep{plan.ep}" if plan.ep > 1 else "")


def _short_rollout(plan: Plan) -> str:
    if plan.rollout is None:
        return "-"
    frac = f" @{plan.rollout_mem_fraction:.2f}" if plan.rollout_mem_fraction else ""
    return f"{plan.rollout} tp{plan.rollout_tp}{frac}"


def render_what_to_rent(console: Console, rows: list[RentRow]) -> None:
    """For each GPU type: the fewest GPUs the job fits on without offload, and with offload allowed."""
    table = Table(
        title="what to rent: the fewest GPUs of each type that fit with the safety margin; first without "
        "offload, then (+ offload) with offload allowed where host memory permits",
        title_justify="left",
    )
    for name in ("GPU", "GPUs", "plan", "GPU GiB", "host GiB/node"):
        table.add_column(name, justify="left" if name in ("GPU", "plan") else "right", no_wrap=name != "plan")
    for row in rows:
        p = row.plan
        name = "  + offload" if row.offload else row.gpu
        if p is None:
            table.add_row(name, "-", "[red]does not fit[/red]", "", "")
            continue
        parts = [_short_layout(p)]
        if p.rollout is not None:
            parts.append(_short_rollout(p))
        if p.offload_params or p.offload_optimizer:
            parts.append(f"offload {_offload(p)}")
        est = p.estimate
        count = f"{row.gpus} ({row.nodes} node{'s' if row.nodes > 1 else ''})"
        peak = f"{est.peak_bytes / GIB:.0f}/{est.gpu_memory_bytes / GIB:.0f}"
        host = f"{est.host_bytes / GIB:.0f}/{est.host_memory_bytes / GIB:.0f}" if est.host_memory_bytes else "-"
        table.add_row(name, count, ", ".join(parts), peak, host)
    console.print(table)


def _checkpointing(plan: Plan) -> str:
    kind = "on" if plan.activation_checkpointing else "selective (MLPs)" if plan.selective_checkpointing else "off"
    return kind + ("; activations offloaded to host" if plan.offload_activations else "")
