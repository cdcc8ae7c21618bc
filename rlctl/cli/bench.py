"""`rlctl bench`: measure rollout, training and conversion throughput, MFU and memory."""

from __future__ import annotations

import typer

from rlctl.errors import NotAvailableYet

app = typer.Typer(
    help="Measure rollout, training and conversion throughput, MFU and memory.",
    epilog="Examples:\n\n  rlctl bench rollout --model tiny --engine hf,vllm\n\n  rlctl bench train --model tiny --method sft --nproc 2\n\n  rlctl bench convert runs/x/checkpoints/step_000010",
    no_args_is_help=True,
)


def _not_yet(what: str) -> None:
    raise NotAvailableYet(f"`rlctl bench {what}` is not available yet")


@app.command()
def rollout() -> None:
    """Generated tokens/s, time to first token and memory for each rollout engine."""
    _not_yet("rollout")


@app.command()
def train() -> None:
    """Tokens/s, step-time split, MFU and peak memory against the estimate."""
    _not_yet("train")


@app.command()
def convert() -> None:
    """Checkpoint conversion GB/s and peak RSS beside a plain copy."""
    _not_yet("convert")
