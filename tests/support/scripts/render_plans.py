"""A large grid of plans rendered as a user sees them, so a refactoring of the planner or of the rules can show
that every plan, warning and refusal is byte-identical.

``python tests/support/scripts/render_plans.py render OUT [--every K]`` runs ``rlctl METHOD ... --dry-run``
(the text) and ``--dry-run --json`` (plan, resolved config, estimate, launch command) in this process for
every case of :func:`grid` (every catalog model x GPU types and counts x sft/grpo/ppo/dpo x option sets;
``--every K``: every K-th case only) on the checkout this file lies in, and writes ``OUT/NAME.txt`` per
case: its arguments, both outputs and their exit codes (a refusal is its one-line error).
``... compare A B`` names every case that differs (exit 1 when any); ``... digest DIR`` prints one sha256
over all the files. To hold a change against the code before it, render on the base (``PYTHONPATH=BASE``,
this file copied there or run from here), render on the change, compare. Torch-free: about a second per
ten cases.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import os
import sys
from pathlib import Path

os.environ["COLUMNS"] = "160"  # rich's width, the same on every run
os.environ.pop("SLURM_JOB_ID", None)
os.environ.pop("SLURM_NODEID", None)

HARDWARE = (("H100", 8), ("A100-40GB", 2), ("L40S", 1), ("H200", 16))
METHODS = ("sft", "grpo", "ppo", "dpo")
# option sets: the rules of what runs with what (each on every model, on 8 H100s, with the methods it fits)
ALL, RL = METHODS, ("grpo", "ppo")
OPTIONS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("lora", ("--lora-rank", "16"), ALL),
    ("pure-bf16", ("--precision", "bf16"), ("sft", "grpo")),
    ("pure-bf16-fp32", ("--precision", "bf16", "--dtype", "fp32"), ("sft", "grpo")),
    ("no-shard", ("--no-shard",), ("sft", "grpo")),
    ("no-shard-1", ("--no-shard", "--gpus", "1"), ("sft",)),
    ("sp2", ("--sp", "2"), ("sft", "grpo")),
    ("sp4-megatron", ("--sp", "4", "--backend", "megatron"), ("sft",)),
    ("megatron", ("--backend", "megatron"), ("sft", "grpo")),
    ("offload", ("--offload-params", "--offload-optimizer"), ("sft", "grpo")),
    ("procs2", ("--rollout-procs", "2"), RL),
    ("procs2-hf", ("--rollout-procs", "2", "--rollout", "hf"), ("grpo",)),
    ("procs4-stale2", ("--rollout-procs", "4", "--max-staleness", "2", "--rollout", "vllm"), ("grpo",)),
    ("procs2-sp2", ("--rollout-procs", "2", "--sp", "2"), ("grpo",)),
    ("procs2-megatron", ("--rollout-procs", "2", "--backend", "megatron"), ("grpo",)),
    ("vllm-tp2", ("--rollout", "vllm", "--rollout-tp", "2"), ("grpo",)),
    ("cpu", ("--device", "cpu", "--nproc", "2"), ("sft", "grpo")),
    ("dynamic", ("--dynamic-sampling",), ("grpo",)),
    ("long-sft", ("--max-len", "65536"), ("sft",)),
    ("long-grpo", ("--max-response-len", "16384"), ("grpo",)),
    ("sp2-vllm-tp2", ("--sp", "2", "--rollout", "vllm", "--rollout-tp", "2"), ("grpo",)),
    ("nodes2", ("--nodes", "2"), ("grpo",)),
)


def model_names() -> list[str]:
    from rlctl.catalog.models import _MODELS

    return [m.name for m in _MODELS]


def grid() -> list[tuple[str, list[str]]]:
    """(name, the arguments after ``rlctl``) for every case, in a fixed order."""
    cases = []
    for model in model_names():
        for (gpu, count), method in itertools.product(HARDWARE, METHODS):
            args = [method, "--model", model, "--gpu", gpu, "--gpus", str(count)]
            cases.append((f"{model}.{method}.{gpu}x{count}", args))
        for (label, extra, methods), method in itertools.product(OPTIONS, METHODS):
            if method in methods:
                args = [method, "--model", model, "--gpu", "H100", "--gpus", "8", *extra]
                cases.append((f"{model}.{method}.{label}", args))
    return cases


def run(args: list[str]) -> tuple[int, str]:
    """``rlctl ARGS`` through the real entry point, in this process: (exit code, stdout + stderr)."""
    from rlctl.cli.app import main

    out = io.StringIO()
    sys.argv = ["rlctl", *args]
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            main()
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return code, out.getvalue()


def render(out_dir: Path, every: int = 1) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = grid()[::every]
    fixed = ["-o", "runs/grid", "--master-port", "29500", "--dry-run"]
    for name, args in cases:
        code, text = run([*args, *fixed])
        jcode, doc = run([*args, *fixed, "--json"])
        body = f"$ rlctl {' '.join(args)}\n[exit {code}]\n{text}\n--- json [exit {jcode}]\n{doc}"
        (out_dir / f"{name}.txt").write_text(body)
    return len(cases)


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(folder.glob("*.txt")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def compare(a: Path, b: Path) -> list[str]:
    """The names present in one folder only or whose bytes differ."""
    names = sorted({p.name for p in a.glob("*.txt")} | {p.name for p in b.glob("*.txt")})
    return [
        n for n in names if not (a / n).exists() or not (b / n).exists() or (a / n).read_bytes() != (b / n).read_bytes()
    ]


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "render":
        every = int(argv[argv.index("--every") + 1]) if "--every" in argv else 1
        print(f"{render(Path(argv[1]), every)} plans rendered into {argv[1]}")
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        differ = compare(Path(argv[1]), Path(argv[2]))
        print("\n".join(differ) or "identical", f"({len(differ)} differ)" if differ else "")
        return 1 if differ else 0
    if len(argv) == 2 and argv[0] == "digest":
        print(digest(Path(argv[1])))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
