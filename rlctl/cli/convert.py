"""`rlctl convert`: FSDP / Megatron checkpoints and LoRA adapters to Hugging Face models, verified.

Thin commands over rlctl.convert (imported inside each command: --help stays fast). Exit codes:
0 done (and verified), 1 verification failed (nothing written), 2 bad input (one line).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from rlctl.names import Dtype, choices

app = typer.Typer(
    help="Turn training checkpoints into Hugging Face models (verified), merge LoRA, inspect checkpoints.",
    epilog=(
        "Examples:\n\n  rlctl convert fsdp-to-hf runs/grpo/checkpoints out/hf\n\n"
        "  rlctl convert lora-merge ./base ./adapter out/merged --dtype bf16\n\n"
        "  rlctl convert inspect verl_ckpts/global_step_300/actor --json\n\n"
        "  rlctl convert hf-to-megatron ./hf out/mcore --tp 2 --pp 2"
    ),
    no_args_is_help=True,
)

DType = Annotated[
    str | None, typer.Option("--dtype", help="bf16 | fp16 | fp32 (default: the dtype config.json declares).")
]
Verify = Annotated[
    bool,
    typer.Option(
        "--verify/--no-verify", help="Load the result with transformers and compare tensors and logits with the source."
    ),
]
Force = Annotated[bool, typer.Option("--force", help="Replace OUT if it exists.")]
ShardSize = Annotated[
    str, typer.Option("--max-shard-size", help="Split safetensors files beyond this size (e.g. 5GB, 500MB).")
]
Trust = Annotated[
    bool,
    typer.Option(
        "--trust-checkpoint",
        help="Unpickle the checkpoint's files fully. They can run code: only for checkpoints from a source you "
        "trust (see docs/security.md). Without it, files needing anything beyond tensors are refused.",
    ),
]
Out = Annotated[Path, typer.Argument(help="Output directory (written under a temporary name, renamed when complete).")]

_DTYPES = choices(Dtype)


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '2GiB' / '1000' -> bytes."""
    from rlctl.errors import UserError

    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise UserError(f"bad size {text!r}; use e.g. 5GB, 500MB or a number of bytes")
    base = 1024 if m.group(3) else 1000
    power = " KMGT".index(m.group(2).upper() or " ")
    return int(float(m.group(1)) * base**power)


def _check_dtype(dtype: str | None) -> str | None:
    from rlctl.errors import UserError, did_you_mean

    if dtype is not None and dtype not in _DTYPES:
        raise UserError(f"unknown --dtype {dtype!r}; use one of {', '.join(_DTYPES)}{did_you_mean(dtype, _DTYPES)}")
    return dtype


def _writing(dtype: str | None, verify: bool, force: bool, max_shard_size: str) -> dict:
    """The options of a conversion that writes a Hugging Face model (rlctl.convert.pipeline), checked."""
    return {
        "dtype": _check_dtype(dtype),
        "verify": verify,
        "force": force,
        "progress": True,
        "max_shard_bytes": parse_size(max_shard_size),
    }


def _console():
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


def _warn_trust(trust: bool) -> None:
    if trust:
        _console().print(
            "[bold yellow]warning:[/] --trust-checkpoint: the checkpoint's pickled files are loaded in full and "
            "can run arbitrary code; use it only for checkpoints from a source you trust"
        )


def _report(result, what: str) -> None:
    """Print notes, folded modules and the verdict; exit 1 when verification failed."""
    console = _console()
    for note in result.notes:
        console.print(f"[dim]note:[/] {note}")
    ckpt = result.checkpoint
    if ckpt is not None:
        world = f", world size {ckpt.world_size}" if ckpt.world_size else ""
        step = f", step {ckpt.step}" if ckpt.step is not None else ""
        console.print(f"source: {ckpt.format}{step}{world} ({ckpt.weights_dir})")
    if result.folded:
        console.print(f"folded LoRA into {len(result.folded)} module(s): {', '.join(result.folded)}")
    if result.adapter_kept:
        console.print(f"LoRA kept as a peft adapter in {result.out_dir / 'adapter'}")
    if result.unknown:
        console.print(f"[yellow]kept tensors the architecture does not use:[/] {', '.join(result.unknown)}")
    _verdict_and_exit(result.verdict, result.committed, result.out_dir, what, result.tensors, result.dtype)


def _verdict_and_exit(
    verdict, committed: bool, out_dir: Path, what: str, tensors: int | None = None, dtype=None
) -> None:
    console = _console()
    if verdict is not None:
        console.print(verdict.table())
    if not committed:
        console.print(
            f"[red]verification failed: {out_dir} was not written[/] (rerun with --no-verify to inspect the raw output)"
        )
        raise typer.Exit(1)
    count = f"{tensors} tensors, " if tensors is not None else ""
    dt = f"{str(dtype).removeprefix('torch.')}, " if dtype is not None else ""
    checked = "verified" if verdict is not None else "not verified"
    console.print(f"[green]wrote {what}[/] {out_dir} ({count}{dt}{checked})")


@app.command("fsdp-to-hf")
def fsdp_to_hf(
    ckpt: Annotated[
        Path,
        typer.Argument(help="rlctl step dir, verl global_step_N or actor dir, or a run/checkpoint root (latest step)."),
    ],
    out: Out,
    dtype: DType = None,
    keep_adapter: Annotated[
        bool, typer.Option("--keep-adapter", help="Write LoRA as a peft adapter in OUT/adapter instead of folding it.")
    ] = False,
    verify: Verify = True,
    force: Force = False,
    max_shard_size: ShardSize = "5GB",
    trust: Trust = False,
) -> None:
    """Merge an FSDP checkpoint (rlctl DCP or verl rank files) into a Hugging Face model."""
    from rlctl.convert.pipeline import fsdp_to_hf as convert

    _warn_trust(trust)
    result = convert(
        ckpt, out, trust=trust, keep_adapter=keep_adapter, **_writing(dtype, verify, force, max_shard_size)
    )
    _report(result, "Hugging Face model")


@app.command("lora-merge")
def lora_merge(
    base: Annotated[Path, typer.Argument(help="Base Hugging Face model directory (safetensors).")],
    adapter: Annotated[
        Path, typer.Argument(help="peft adapter directory (adapter_config.json + adapter_model.safetensors).")
    ],
    out: Out,
    dtype: DType = None,
    verify: Verify = True,
    force: Force = False,
    max_shard_size: ShardSize = "5GB",
) -> None:
    """Fold a LoRA adapter into its base model: W + (alpha/r)·B@A (alpha/sqrt(r) with rsLoRA)."""
    from rlctl.convert.pipeline import lora_merge as merge

    result = merge(base, adapter, out, **_writing(dtype, verify, force, max_shard_size))
    _report(result, "merged model")


@app.command("inspect")
def inspect(
    ckpt: Annotated[Path, typer.Argument(help="Any checkpoint: rlctl, verl FSDP, Megatron, HF model or peft adapter.")],
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    trust: Trust = False,
) -> None:
    """Say what a checkpoint is (format, world size or tp/pp, dtype, parameters, step, LoRA) without converting."""
    import json

    from rlctl.convert.inspect import inspect_checkpoint, render

    _warn_trust(trust)
    info = inspect_checkpoint(ckpt, trust=trust)
    if json_:
        typer.echo(json.dumps(info, indent=2, default=str))
    else:
        from rich.console import Console

        Console().print(render(info))


@app.command("hf-to-megatron")
def hf_to_megatron(
    hf: Annotated[Path, typer.Argument(help="Hugging Face model directory (safetensors).")],
    out: Out,
    tp: Annotated[int, typer.Option("--tp", help="Tensor-parallel size.")] = 1,
    pp: Annotated[int, typer.Option("--pp", help="Pipeline-parallel size.")] = 1,
    verify: Annotated[
        bool, typer.Option("--verify/--no-verify", help="Read the shards back and compare with the HF tensors.")
    ] = True,
    force: Force = False,
) -> None:
    """Split a Hugging Face model into Megatron TP/PP shards (mcore GPTModel layout)."""
    import shutil

    from rlctl.convert.megatron_io import load_megatron_to_hf, save_megatron_shards
    from rlctl.convert.verify import hf_quiet, verify_roundtrip
    from rlctl.formats.hf_writer import check_out_dir, commit_dir, temp_sibling

    out = out.absolute()
    check_out_dir(out, force, inputs=[hf])
    tmp = temp_sibling(out)
    try:
        save_megatron_shards(hf, tmp, tp, pp)
        verdict = None
        if verify:
            with hf_quiet():
                verdict = verify_roundtrip(hf, load_megatron_to_hf(tmp))
        if verdict is None or verdict.ok:
            commit_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _verdict_and_exit(verdict, verdict is None or verdict.ok, out, f"Megatron shards (tp={tp}, pp={pp})")


@app.command("megatron-to-hf")
def megatron_to_hf(
    ckpt: Annotated[
        Path,
        typer.Argument(
            help="rlctl Megatron shards, a megatron-core torch_dist dir, or a verl actor dir with dist_ckpt/."
        ),
    ],
    out: Out,
    hf_config: Annotated[
        Path | None,
        typer.Option("--hf-config", help="HF model dir (config + tokenizer) when the checkpoint carries none."),
    ] = None,
    dtype: DType = None,
    verify: Verify = True,
    force: Force = False,
    max_shard_size: ShardSize = "5GB",
    trust: Trust = False,
) -> None:
    """Merge a Megatron checkpoint into a Hugging Face model."""
    from rlctl.convert.megatron_io import load_megatron_to_hf
    from rlctl.convert.verify import verify_model, write_verified
    from rlctl.formats.hf_writer import check_out_dir, config_dtype, resolve_dtype
    from rlctl.formats.safetensors import read_hf_config

    _warn_trust(trust)
    out = out.absolute()
    meta_dir = _megatron_meta_dir(ckpt, hf_config)
    check_out_dir(out, force, inputs=[ckpt, meta_dir, hf_config])
    target = resolve_dtype(_check_dtype(dtype)) or config_dtype(read_hf_config(meta_dir))
    stream = load_megatron_to_hf(ckpt, hf_config, trust=trust)
    written = write_verified(
        out,
        stream,
        meta_dir=meta_dir,
        dtype=target,
        force=force,
        progress=True,
        verify=(
            (lambda tmp: verify_model(tmp, load_megatron_to_hf(ckpt, hf_config, trust=trust), dtype=target))
            if verify
            else None
        ),
        max_shard_bytes=parse_size(max_shard_size),
    )
    _verdict_and_exit(written.verdict, written.committed, out, "Hugging Face model", dtype=target)


def _megatron_meta_dir(ckpt: Path, hf_config: Path | None) -> Path:
    """The directory holding config.json and the tokenizer for a Megatron checkpoint."""
    from rlctl.errors import UserError

    candidates = []
    if hf_config is not None:
        candidates.append(hf_config if hf_config.is_dir() else hf_config.parent)
    candidates += [ckpt / "huggingface", ckpt.parent / "huggingface"]
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return candidate
    raise UserError(f"{ckpt}: no huggingface/config.json found with the checkpoint; pass --hf-config HF_DIR")
