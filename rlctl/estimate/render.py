"""Rich rendering of a :class:`~rlctl.estimate.memory.MemoryEstimate` for the terminal."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rlctl.estimate.memory import GIB, MemoryEstimate

LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "unsharded_buffers": "FSDP unsharded layers",
    "activations": "activations",
    "logits": "logits (loss)",
    "reference_model": "reference model",
    "critic": "critic (idle)",
    "engine_weights": "engine weights",
    "kv_cache": "KV cache",
    "engine_activations": "engine activations",
    "cuda_graphs": "CUDA graphs",
    "trainer_weights": "trainer weights (resident)",
    "trainer_gradients": "trainer gradients (resident)",
    "trainer_optimizer": "trainer optimizer (resident)",
    "cuda_context": "CUDA context + NCCL",
}


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def render_estimate(console: Console, est: MemoryEstimate) -> None:
    """Phases by component in GiB, the KV cache, peak against GPU memory, verdict, assumptions."""
    s = est.settings
    where = f"{s.gpus} x {est.gpu}" if s.device == "cuda" else f"{s.gpus} CPU process(es)"
    table = Table(title=f"memory per GPU: {est.model} ({est.params / 1e9:.2f}B), {s.method}, {where}", title_justify="left")
    table.add_column("component")
    names = list(est.phases)
    for name in names:
        table.add_column(f"{name} (GiB)", justify="right")
    components: list[str] = []
    for phase in est.phases.values():
        components += [c for c in phase.components if c not in components]
    for comp in components:
        cells = [est.phases[n].components.get(comp, 0) for n in names]
        if any(cells):
            table.add_row(LABELS.get(comp, comp), *[gib(v) if v else "-" for v in cells])
    table.add_section()
    table.add_row("total", *[gib(est.phases[n].total_bytes) for n in names], style="bold")
    console.print(table)
    notes = {n: p.note for n, p in est.phases.items() if p.note and p.note != "every GPU"}
    for name, note in notes.items():
        console.print(f"  {name}: the busiest GPU is {note}")
    if s.is_rl:
        console.print(
            f"KV cache: {gib(est.kv_cache_bytes)} GiB per GPU = {est.kv_cache_tokens:,} tokens "
            f"({est.kv_bytes_per_token:,} bytes each) = {est.kv_cache_sequences:,} sequences of {s.seq_len} tokens at once"
        )
    color = "green" if est.fits else "red"
    console.print(
        f"peak {gib(est.peak_bytes)} GiB ({est.peak_phase}) of {gib(est.gpu_memory_bytes)} GiB; "
        f"headroom {gib(est.headroom_bytes)} GiB"
    )
    console.print(f"[{color}]{escape(est.verdict)}[/{color}]")
    console.print("[dim]assumptions:[/dim]")
    for line in est.assumptions:
        console.print(f"[dim]  - {escape(line)}[/dim]", highlight=False)
