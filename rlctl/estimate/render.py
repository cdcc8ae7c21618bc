"""Rich rendering of a :class:`~rlctl.estimate.memory.MemoryEstimate` for the terminal."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlctl.estimate.memory import GIB, MemoryEstimate, Phase
from rlctl.estimate.result import component_rows

LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "unsharded_buffers": "FSDP unsharded layers",
    "activations": "activations",
    "sp_all_to_all": "Ulysses all-to-all",
    "vision_activations": "vision tower activations",
    "logits": "logits (loss)",
    "reference_model": "reference model",
    "teacher_model": "teacher model (distillation)",
    "reward_model": "reward model",
    "critic": "critic (idle)",
    "engine_weights": "engine weights",
    "engine_packed_weights": "engine weights, oneDNN-packed copy (CPU)",
    "kv_cache": "KV cache",
    "engine_activations": "engine activations",
    "cuda_graphs": "CUDA graphs",
    "trainer_weights": "trainer weights (resident)",
    "trainer_gradients": "trainer gradients (resident)",
    "trainer_optimizer": "trainer optimizer (resident)",
    "cuda_context": "CUDA context + NCCL",
}

HOST_LABELS = {
    "offloaded_weights": "offloaded weights",
    "offloaded_gradients": "offloaded gradients",
    "offloaded_optimizer": "offloaded optimizer states",
    "reference_model": "reference model (offloaded)",
    "teacher_model": "teacher model (offloaded)",
    "critic": "critic (offloaded)",
    "engine_weights": "engine weights (asleep)",
    "checkpoint": "checkpoint (rank 0 loading)",
    "processes": "processes",
    "offloaded_activations": "offloaded activations",
    "save_optimizer_copy": "save: gathered optimizer states",
    "save_gather_buffers": "save: all-gather buffers",
    "save_write_copies": "save: writer's copies",
}


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _phase_table(title: str, phases: dict[str, Phase], labels: dict[str, str], device: bool = False) -> Table:
    """Components (rows) by phase (columns), in GiB, with a total row."""
    table = Table(title=title, title_justify="left")
    table.add_column("component")
    names = list(phases)
    for name in names:
        table.add_column(f"{name} (GiB)", justify="right")
    for comp, cells in component_rows(phases):
        table.add_row(labels.get(comp, comp), *[gib(v) if v else "-" for v in cells])
    table.add_section()
    if device:
        table.add_row("allocated (torch max_memory_allocated)", *[gib(phases[n].allocated_bytes) for n in names])
        table.add_row("reserved (torch max_memory_reserved)", *[gib(phases[n].reserved_bytes) for n in names])
        table.add_row("device: reserved + context + engine pools", *[gib(phases[n].total_bytes) for n in names])
        table.add_row("fits verdict uses", *["device + margin" for _ in names], style="bold")
        return table
    table.add_row("total", *[gib(phases[n].total_bytes) for n in names], style="bold")
    return table


def render_estimate(console: Console, est: MemoryEstimate) -> None:
    """Phases by component in GiB (per GPU, then host memory per node), the KV cache, peak against
    GPU and host memory, verdict, assumptions."""
    s = est.settings
    where = f"{s.gpus} x {est.gpu}" if s.device == "cuda" else f"{s.gpus} CPU process(es)"
    title = f"memory per GPU: {est.model} ({est.params / 1e9:.2f}B), {s.method}, {where}"
    console.print(_phase_table(title, est.phases, LABELS, device=True))
    if est.host_phases:
        per_node = f"{s.gpus_per_node} GPU{'s' if s.gpus_per_node > 1 else ''}"
        console.print(_phase_table(f"host memory per node ({per_node})", est.host_phases, HOST_LABELS))
    notes = {n: p.note for n, p in est.phases.items() if p.note and p.note != "every GPU"}
    for name, note in notes.items():
        console.print(f"  {name}: the busiest GPU is {note}")
    if s.is_rl:
        console.print(
            f"KV cache: {gib(est.kv_cache_bytes)} GiB per GPU = {est.kv_cache_tokens:,} tokens "
            f"({est.kv_bytes_per_token:,} bytes each) = {est.kv_cache_sequences:,} sequences "
            f"of {s.seq_len} tokens at once"
        )
    color = "green" if est.fits else "red"
    console.print(
        f"peak {gib(est.peak_bytes)} GiB ({est.peak_phase}) of {gib(est.gpu_memory_bytes)} GiB; "
        f"headroom {gib(est.headroom_bytes)} GiB"
    )
    if est.host_phases:
        known = (
            f"of {gib(est.host_memory_bytes)} GiB ({gib(est.host_limit_bytes)} usable)"
            if est.host_memory_bytes
            else "(host memory unknown: not checked)"
        )
        console.print(f"host memory per node: {gib(est.host_bytes)} GiB ({est.host_peak_phase}) {known}")
    console.print(f"[{color}]{escape(est.verdict)}[/{color}]")
    console.print("[dim]assumptions:[/dim]")
    for line in est.assumptions:
        console.print(f"[dim]  - {escape(line)}[/dim]", highlight=False)
