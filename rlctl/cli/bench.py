"""`rlctl bench`: measure rollout, training and conversion throughput, MFU and memory.

Thin commands over rlctl.bench (imported inside each command: --help stays fast). Each prints
tables, or one JSON object with --json (progress goes to stderr), and draws bars with --plot.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from rlctl import names
from rlctl.names import describe

EXAMPLES = """Examples:

  rlctl bench rollout --model tiny --engine hf,vllm --prompts 8 --n 4

  rlctl bench train --model tiny --method sft --nproc 2 --steps 4

  rlctl bench train --model Qwen2.5-0.5B --random-init --method grpo --gpus 1

  rlctl bench convert runs/x/checkpoints/step_000010 --verify

  rlctl bench compare --peer trl --model tiny --work sft,grpo --json
"""

app = typer.Typer(
    help="Measure rollout, training and conversion throughput, MFU and memory.",
    epilog=EXAMPLES,
    no_args_is_help=True,
)

Model = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="`tiny` (built-in demo model), a local HF directory, or a catalog name with --random-init.",
    ),
]
RandomInit = Annotated[
    bool, typer.Option("--random-init", help="Random weights from the catalog config (nothing is downloaded).")
]
Device = Annotated[
    str | None,
    typer.Option("--device", help=f"{describe(names.Device)} (default: cuda when a GPU is visible, else cpu)."),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object (progress goes to stderr).")]
Plot = Annotated[
    Path | None,
    typer.Option("--plot", help="Draw throughput and memory bars into this file (.png, .svg; needs matplotlib)."),
]
Seed = Annotated[int, typer.Option("--seed", help="Random seed of the prompts and sampling.")]
Lengths = Annotated[
    str,
    typer.Option(
        "--lengths",
        help="sft: fixed (every sequence --seq-len tokens) | spread (log-uniform up to --seq-len, like real "
        "chats; compare uses benchmarks/sft_vs_trl.py's chats and adds TRL with packing at the same batch size).",
    ),
]

SeqLen = Annotated[int, typer.Option("--seq-len", help="sft: tokens per sequence.")]
# bench train's options of the training job itself
TrainSteps = Annotated[
    int, typer.Option("--steps", help="Optimizer steps (the first is a warm-up, left out of the medians).")
]
TrainBatch = Annotated[
    int, typer.Option("--batch-size", help="Sequences (sft) or prompts (RL) per step (default 8 / 4).")
]
MicroBatch = Annotated[int, typer.Option("--micro-batch-size", help="Sequences per forward (default: the plan's).")]
Sets = Annotated[
    list[str] | None, typer.Option("--set", "-s", help="key=value passed to the job's config, repeatable.")
]
OutputDir = Annotated[
    str | None,
    typer.Option(
        "--output-dir", "-o", help="Keep the data and the run here (default: a temporary directory, removed)."
    ),
]


def _log():
    from rich.console import Console

    console = Console(stderr=True)
    return lambda msg: console.print(f"[dim]{msg}[/dim]")


def _given(value: str | None) -> str | None:
    """A value the plan or the benchmark decides when None; the word "auto" (older usage) reads as None."""
    from rlctl.config import is_auto

    return None if value is None or is_auto(value) else value


def _device(device: str | None) -> str:
    from rlctl.errors import UserError, did_you_mean

    device = _given(device)
    allowed = names.choices(names.Device)
    if device is not None and device not in allowed:
        raise UserError(f"unknown --device {device!r}{did_you_mean(device, allowed)}; use {describe(names.Device)}")
    if device is not None:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _emit(doc: dict, as_json: bool, plot: Path | None) -> None:
    if plot is not None:
        from rlctl.bench.plot import plot as draw

        doc["plot"] = str(draw(doc, plot))
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        from rlctl.bench.tables import render

        render(doc)


@app.command()
def rollout(
    model: Model,
    random_init: RandomInit = False,
    engine: Annotated[
        str, typer.Option("--engine", help="Comma list of rollout engines: hf, vllm, sglang.")
    ] = "hf,vllm",
    prompts: Annotated[int, typer.Option("--prompts", help="Prompts per batch.")] = 8,
    n: Annotated[int, typer.Option("--n", help="Samples per prompt.")] = 4,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Tokens per (random) prompt.")] = 64,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most tokens generated per sample.")] = 32,
    reps: Annotated[int, typer.Option("--reps", help="Timed repetitions (interleaved across engines).")] = 3,
    device: Device = None,
    dtype: Annotated[
        str | None, typer.Option("--dtype", help=f"{describe(names.Dtype)} (default: bf16 on GPU, fp32 on CPU).")
    ] = None,
    mem_fraction: Annotated[
        float,
        typer.Option("--mem-fraction", help="GPU memory share of each vLLM/SGLang engine (they run side by side)."),
    ] = 0.4,
    seed: Seed = 0,
    json_: Json = False,
    plot: Plot = None,
) -> None:
    """Generated tokens/s, time to first token, shared-prefix effect and peak memory of each engine."""
    from rlctl.bench.common import envelope
    from rlctl.bench.models import resolve_bench_model
    from rlctl.bench.rollout import RolloutSettings, bench_rollout

    dev = _device(device)
    s = RolloutSettings(
        prompts=prompts,
        n=n,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        reps=reps,
        device=dev,
        dtype=_given(dtype) or ("fp32" if dev == "cpu" else "bf16"),
        mem_fraction=mem_fraction,
        seed=seed,
    )
    s.check()
    m = resolve_bench_model(model, random_init=random_init)
    engines = [e.strip() for e in engine.split(",") if e.strip()]
    rows = bench_rollout(m.path, engines, s, log=_log())
    doc = envelope("rollout", {"model": model, **asdict(s), "engines": engines}, rows)
    _emit(doc, json_, plot)
    if all(r.get("error") for r in rows):
        raise typer.Exit(1)


@app.command()
def train(
    model: Model,
    method: Annotated[str, typer.Option("--method", help=f"{describe(names.Method)}.")] = "sft",
    random_init: RandomInit = False,
    device: Device = None,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs in total (0 = every visible GPU).")] = 0,
    gpu: Annotated[str, typer.Option("--gpu", help="GPU type for the plan and the MFU peak (default: detected).")] = "",
    nproc: Annotated[int, typer.Option("--nproc", help="Processes (default: GPUs, or 1 on CPU).")] = 0,
    steps: TrainSteps = 3,
    batch_size: TrainBatch = 0,
    seq_len: SeqLen = 128,
    lengths: Lengths = "fixed",
    n: Annotated[int, typer.Option("--n", help="RL: samples per prompt.")] = 4,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="RL: tokens per prompt (about).")] = 32,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="RL: most tokens per response.")] = 32,
    rollout: Annotated[
        str | None, typer.Option("--rollout", help=f"RL: {describe(names.RolloutEngine)} (default: the plan's).")
    ] = None,
    micro_batch_size: MicroBatch = 0,
    lora_rank: Annotated[int, typer.Option("--lora-rank", help="LoRA rank (0 = full fine-tuning).")] = 0,
    teacher: Annotated[
        str,
        typer.Option(
            "--teacher",
            help="RL: on-policy distillation from this teacher (a local HF directory, or a catalog name with "
            "--random-init: random weights written to disk once).",
        ),
    ] = "",
    set_: Sets = None,
    output_dir: OutputDir = None,
    seed: Seed = 0,
    json_: Json = False,
    plot: Plot = None,
) -> None:
    """Tokens/s, step-time split, MFU and peak memory beside the estimate, from a real run."""
    from rlctl.bench.common import envelope
    from rlctl.bench.models import resolve_bench_model
    from rlctl.bench.train import TrainSettings, bench_train

    s = TrainSettings(
        method=method,
        steps=steps,
        device=_given(device),
        nproc=nproc,
        gpus=gpus,
        gpu=gpu,
        batch_size=batch_size,
        seq_len=seq_len,
        lengths=lengths,
        n=n,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        rollout=_given(rollout),
        micro_batch_size=micro_batch_size,
        lora_rank=lora_rank,
        teacher=teacher,
        sets=list(set_ or []),
        seed=seed,
    )
    s.check()
    if teacher:  # the teacher is loaded from its files: a catalog name gets random weights on disk
        s.teacher = str(resolve_bench_model(teacher, random_init=random_init).path)
    m = resolve_bench_model(model, random_init=random_init, need_weights=False)
    row = bench_train(m, s, output_dir=output_dir, log=_log())
    _emit(envelope("train", {"model": model, **asdict(s)}, [row]), json_, plot)


@app.command()
def convert(
    checkpoint: Annotated[
        Path, typer.Argument(help="An rlctl step dir, a verl actor dir, or a run / checkpoints dir (latest step).")
    ],
    verify: Annotated[bool, typer.Option("--verify", help="Also time the conversion with verification.")] = False,
    work: Annotated[
        Path | None,
        typer.Option("--work", help="Scratch directory for the copies and outputs (default: the system temp dir)."),
    ] = None,
    json_: Json = False,
    plot: Plot = None,
) -> None:
    """fsdp-to-hf GB/s and peak RSS beside a plain copy of the same files."""
    from rlctl.bench.common import envelope
    from rlctl.bench.convert import bench_convert

    row = bench_convert(checkpoint, verify=verify, work=work)
    _emit(envelope("convert", {"checkpoint": str(checkpoint), "verify": verify}, [row]), json_, plot)


@app.command()
def compare(
    model: Model,
    peer: Annotated[str, typer.Option("--peer", help="The other framework: trl.")] = "trl",
    random_init: RandomInit = False,
    work: Annotated[str, typer.Option("--work", help="Comma list: rollout, sft, grpo.")] = "rollout,sft,grpo",
    reps: Annotated[int, typer.Option("--reps", help="Runs of each side, alternating.")] = 2,
    steps: Annotated[int, typer.Option("--steps", help="Steps per training run (the first is a warm-up).")] = 3,
    device: Device = None,
    engine: Annotated[
        str, typer.Option("--engine", help="rlctl's rollout engine for the rollout and grpo work.")
    ] = "hf",
    prompts: Annotated[int, typer.Option("--prompts", help="Prompts per batch (rollout, grpo).")] = 4,
    n: Annotated[int, typer.Option("--n", help="Samples per prompt (rollout, grpo).")] = 4,
    prompt_len: Annotated[int, typer.Option("--prompt-len", help="Tokens per prompt (about).")] = 32,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most tokens per response.")] = 32,
    batch_size: Annotated[int, typer.Option("--batch-size", help="sft: sequences per step.")] = 8,
    seq_len: SeqLen = 128,
    lengths: Lengths = "fixed",
    seed: Seed = 0,
    json_: Json = False,
    plot: Plot = None,
) -> None:
    """The same rollout / SFT / GRPO work through TRL and rlctl, interleaved, with ratios."""
    from rlctl.bench.common import envelope
    from rlctl.bench.compare import CompareSettings, bench_compare
    from rlctl.bench.models import resolve_bench_model

    s = CompareSettings(
        peer=peer,
        work=[w.strip() for w in work.split(",") if w.strip()],
        reps=reps,
        steps=steps,
        device=_device(device),
        engine=engine,
        prompts=prompts,
        n=n,
        prompt_len=prompt_len,
        max_tokens=max_tokens,
        batch_size=batch_size,
        seq_len=seq_len,
        lengths=lengths,
        seed=seed,
    )
    s.check()
    m = resolve_bench_model(model, random_init=random_init)
    rows = bench_compare(m, s, log=_log())
    _emit(envelope("compare", {"model": model, **asdict(s)}, rows), json_, plot)
