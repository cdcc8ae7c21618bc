"""Trained tokens per second: `rlctl sft` against TRL's SFTTrainer, on this CPU, and the FLOP limit.

    python benchmarks/sft_vs_trl.py [--rounds 3] [--steps 8] [--packed-steps 3] [--batch-size 8] [--max-len 1024]

One round takes about 9 minutes of one idle core (trl-packing ~4, trl ~3, rlctl and trl-packing-1row
~1.5 each); ``--only rlctl,trl-packing`` runs some columns only.

Both train the same tiny Qwen2 model (rlctl.testing.build_tiny_model, ~25M parameters) on the same
chats (rendered lengths log-uniform from a few dozen tokens to max-len, as in real SFT data), with the
same max length, learning rate, loss on the assistant tokens only, no activation checkpointing, one
process with one thread each. The runs are interleaved (every column once per round) so that a change
in the machine's load hits all of them alike; the table gives the median over rounds.

Columns:

* ``rlctl``: ``rlctl sft`` with its default plan (no speed flag), ``--batch-size`` conversations per
  step: packed rows whose attention is split per document (rlctl.engines.varlen), so a row costs the
  sum of its documents' squared lengths.
* ``trl``: SFTTrainer's defaults, ``per_device_train_batch_size = --batch-size``: each batch right-
  padded to its longest conversation, with an attention mask (sdpa with a [B, 1, L, L] mask).
* ``trl-packing`` (issue 11's target): ``packing=True`` at the same ``per_device_train_batch_size``.
  What TRL 1.16 does with it (site-packages/trl/trainer/sft_trainer.py, transformers 5.x):
  ``_prepare_dataset`` packs the tokenized conversations best-fit-decreasing into rows of at most
  max-len tokens (``pack_dataset(..., "bfd")``, trl/data_utils.py ``_pack_bfd``, which keeps a
  ``seq_lengths`` column); ``packing_strategy="bfd"`` turns on ``padding_free`` (SFTTrainer.__init__:
  ``self.padding_free = args.padding_free or (args.packing and args.packing_strategy in {"bfd",
  "bfd_split"})``); ``DataCollatorForLanguageModeling.torch_call`` with ``padding_free`` then
  concatenates the batch's rows into ONE row (``input_ids = [torch.cat(input_ids, dim=0)]``) with
  ``position_ids`` restarting at 0 per conversation and no ``attention_mask`` (plus ``cu_seq_lens_*``,
  which only flash-attention kernels read). A step is one sequence of up to batch x max-len tokens
  (~8,000 here). Under sdpa (no flash-attn on a CPU), transformers' ``create_causal_mask``
  (transformers/masking_utils.py) sees ``attention_mask is None`` and ``position_ids``, finds the
  documents (``find_packed_sequence_indices``), ANDs the causal mask with a same-document mask and
  sets ``allow_is_causal_skip = False``: sdpa gets a materialized [1, 1, T, T] boolean mask over the
  whole concatenated row and computes every one of the T^2 query-key pairs, most of them masked out.
* ``trl-packing-1row``: ``packing=True`` with ``per_device_train_batch_size=1``: one packed row of at
  most max-len tokens per step, TRL's most favourable packed setting here (attention over max-len,
  not batch x max-len), with as many steps as make about the same number of tokens as the rlctl run.
  Not the issue's setting; shown for what packing can give TRL on this CPU.

Measured: real (non-padding) tokens trained per CPU second (user + system time of the training
process: the machine is shared, so this is the steadier figure) and per wall second, between the end
of step WARMUP_STEPS (trl-packing: PACKED_WARMUP_STEPS, its steps being ~3.5x larger) and the end of
the last step. Tokens are every token of every conversation in
the step (prompt and answer, chat template included), the same definition on all sides: rlctl's
``tokens`` of RUN/metrics.jsonl (``sum(len(example))``, rlctl/recipes/sft.py); for TRL the worker
counts the non-padding tokens of each batch it trains on (``attention_mask.sum()``, or every token of
the padding-free row), which is also what TRL logs as ``num_tokens``. TRL's rendering of a
conversation may differ from rlctl's by a token or two; the worker reports its total tokens per
conversation so that this can be checked (``tokens_per_chat``).

FLOP limit: model FLOPs per trained token (rlctl.bench.mfu: 6 N + 6 L s (d_qk + d_v), with ``s`` the
token-weighted mean document length, sum(n^2) / sum(n): the attention each document needs, not the
cross-document pairs a framework may also compute), against the fp32 peak of this CPU measured in the
same run (best of 1024 x 1024 matmuls, one thread, before and after the rounds). peak / FLOPs per
token is the tokens per second no framework can beat in fp32 on one thread; each column's MFU is its
share of it (per CPU second). The load average is recorded with each run; the raw figures go to --json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rlctl.bench.chats import make_chats, render_ids

WARMUP_STEPS = 2  # steps left out of the throughput (first-call allocations, lazy inits)
# trl-packing's steps hold batch-size x max-len tokens (~3.5 of the other columns' steps): its first step
# covers the warm-up, and two measured steps keep one round under 10 minutes on an idle machine
PACKED_WARMUP_STEPS = 1


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def find_rank_pid(recipe: str, run_dir: Path) -> int | None:
    """The pid of the torchrun worker running ``python -m rlctl.recipes.<recipe> --run-dir RUN_DIR``
    (not the torchrun launcher, whose command line names the recipe too)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        worker = f"rlctl.recipes.{recipe}".encode() in args and b"torch.distributed.run" not in args
        if worker and {str(run_dir).encode(), str(run_dir.resolve()).encode()} & set(args):
            return int(entry.name)
    return None


def run_rlctl_clocked(argv: list[str], run_dir: Path, recipe: str, log_path: Path) -> dict[int, tuple[float, float]]:
    """Run an rlctl command; return {training records written: (rank CPU seconds, wall time)} sampled
    each time RUN_DIR/metrics.jsonl grows (polled every 5 ms)."""
    marks: dict[int, tuple[float, float]] = {}
    metrics = run_dir / "metrics.jsonl"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env=_env(), stdout=log, stderr=subprocess.STDOUT)
        pid = None
        while proc.poll() is None:
            pid = pid or find_rank_pid(recipe, run_dir)
            if pid and metrics.exists():
                n = sum('"kind": "eval"' not in line for line in metrics.read_text().splitlines())
                if n not in marks:
                    try:
                        marks[n] = (proc_cpu_seconds(pid), time.perf_counter())
                    except OSError:  # the rank has exited
                        pass
            time.sleep(0.005)
    if proc.returncode:
        raise SystemExit(f"{argv[3]} failed; see {log_path}")
    return marks


def measured(marks: dict[int, tuple[float, float]], step_tokens: list[float], warmup: int = WARMUP_STEPS) -> dict:
    """Tokens per CPU second and per wall second from the end of step ``warmup`` (or the first
    step seen after it) to the end of the last step."""
    seen = sorted(n for n in marks if n >= warmup)
    first, last = seen[0], seen[-1]
    tokens = sum(step_tokens[first:last])
    cpu = marks[last][0] - marks[first][0]
    wall = marks[last][1] - marks[first][1]
    return {
        "tokens": tokens,
        "cpu_s": cpu,
        "wall_s": wall,
        "steps": last - first,
        "tokens_per_cpu_s": tokens / cpu,
        "tokens_per_s": tokens / wall,
    }


def rlctl_run(args, model: Path, data: Path, out: Path) -> dict:
    argv = [
        sys.executable,
        "-m",
        "rlctl",
        "sft",
        "--model",
        str(model),
        "--data",
        str(data),
        "--device",
        "cpu",
        "--nproc",
        "1",
        "--max-len",
        str(args.max_len),
        "--batch-size",
        str(args.batch_size),
        "--max-steps",
        str(args.steps),
        "--lr",
        "1e-4",
        "-o",
        str(out),
        "--seed",
        "0",
        "--set",
        "parallel.activation_checkpointing=false",
        "--set",
        "checkpoint.export_hf=false",
    ]
    load = os.getloadavg()[0]
    marks = run_rlctl_clocked(argv, out, "sft", out.parent / f"{out.name}.log")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("kind") != "eval"]
    return {**measured(marks, [r["tokens"] for r in steps]), "load": load, "load_end": os.getloadavg()[0]}


def trl_run(
    args, model: Path, data: Path, out: Path, *, batch: int, steps: int, packing: bool, warmup: int = WARMUP_STEPS
) -> dict:
    argv = [
        sys.executable,
        __file__,
        "--trl-worker",
        "--model",
        str(model),
        "--data",
        str(data),
        "--out",
        str(out),
        "--max-len",
        str(args.max_len),
        "--batch-size",
        str(batch),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
    ]
    if packing:
        argv.append("--packing")
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    with open(out.parent / f"{out.name}.log", "w") as log:
        subprocess.run(argv, check=True, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    return {**json.loads((out / "result.json").read_text()), "load": load, "load_end": os.getloadavg()[0]}


def trl_worker(args) -> None:
    """One TRL SFTTrainer run (in its own process); writes OUT/result.json."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(1)
    out = Path(args.out)
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    # prompt/completion rows: TRL then computes the loss on the completion (the assistant turn) only
    ds = Dataset.from_list([{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in rows])
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    marks: dict[int, tuple[float, float]] = {0: (time.process_time(), time.perf_counter())}
    step_tokens: list[int] = [0]
    row_lengths: list[int] = []  # the longest sequence (row) of each step: what its attention is quadratic in

    class Clock(TrainerCallback):
        def on_step_end(self, cfg, state, *a, **k):
            marks[state.global_step] = (time.process_time(), time.perf_counter())
            cpu = marks[state.global_step][0] - marks[state.global_step - 1][0]
            print(f"step {state.global_step}: {step_tokens[-1]} tokens, {cpu:.1f} CPU s", flush=True)
            step_tokens.append(0)

    class CountingTrainer(SFTTrainer):
        def training_step(self, model, inputs, *a, **k):
            # real tokens: TRL's own count (num_tokens); a padding-free row has no padding
            mask = inputs.get("attention_mask")
            step_tokens[-1] += int(mask.sum()) if mask is not None else inputs["input_ids"].numel()
            row_lengths.append(inputs["input_ids"].shape[1])
            return super().training_step(model, inputs, *a, **k)

    config = SFTConfig(
        output_dir=str(out),
        max_length=args.max_len,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=1e-4,
        lr_scheduler_type="cosine",
        gradient_checkpointing=False,
        packing=args.packing,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1000,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = CountingTrainer(model=model, args=config, train_dataset=ds, processing_class=tok, callbacks=[Clock()])
    prepared = trainer.train_dataset
    per_chat = [len(x) for x in (prepared["seq_lengths"] if args.packing else prepared["input_ids"])]
    chat_tokens = sum(sum(x) for x in prepared["seq_lengths"]) if args.packing else sum(per_chat)
    chats = sum(per_chat) if args.packing else len(per_chat)
    trainer.train()
    out.mkdir(parents=True, exist_ok=True)
    result = {
        **measured(marks, step_tokens, args.warmup),
        "batch_size": args.batch_size,
        "packing": args.packing,
        "padding_free": bool(trainer.padding_free),
        "tokens_per_chat": chat_tokens / chats,
        "longest_row": max(row_lengths),
        "mean_row": statistics.mean(row_lengths),
    }
    (out / "result.json").write_text(json.dumps(result))


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def fp32_peak(repeats: int = 3) -> float:
    """Best fp32 FLOP/s of 1024 x 1024 matmuls in this process with one thread (best of ``repeats`` 1 s tries)."""
    import torch

    from rlctl.bench.mfu import matmul_rate

    torch.set_num_threads(1)
    return max(matmul_rate(1024, 1.0) for _ in range(repeats))


def flops_per_token(model: Path, lengths: list[int]) -> dict:
    """Model training FLOPs per token (rlctl.bench.mfu) with each document attending to itself only."""
    from rlctl.bench import mfu as M
    from rlctl.catalog.hf_config import spec_from_path

    spec = spec_from_path(model)
    s = sum(n * n for n in lengths) / sum(lengths)  # token-weighted mean document length
    return {
        "params_N": M.flops_params(spec),
        "attention_s": s,
        "flops_per_token": M.train_flops_per_token(spec, s),
        "matmul_only_flops_per_token": 6 * M.flops_params(spec),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="steps of the rlctl and padded TRL runs (warm-up included)")
    ap.add_argument(
        "--packed-steps",
        type=int,
        default=PACKED_WARMUP_STEPS + 2,
        help=f"steps of the trl-packing run (batch-size rows of max-len each; the first {PACKED_WARMUP_STEPS} warm up)",
    )
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=512, help="model width (heads of 64)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--only", default="", help="comma-separated columns to run (default: all)")
    ap.add_argument("--out", default="runs/bench-sft")
    ap.add_argument("--json", default="benchmarks/results/speed/sft-vs-trl.json")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--packing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=WARMUP_STEPS, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    if args.steps <= WARMUP_STEPS or args.packed_steps <= PACKED_WARMUP_STEPS:
        raise SystemExit(f"--steps must exceed {WARMUP_STEPS} and --packed-steps {PACKED_WARMUP_STEPS} (warm-up)")

    import shutil

    from rlctl.testing import build_tiny_model, build_tokenizer

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    model = build_tiny_model(
        out / "model",
        seed=0,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        num_hidden_layers=args.layers,
        max_position_embeddings=args.max_len,
    )
    tok = build_tokenizer()
    # enough chats for every run within one epoch: trl-packing takes batch-size rows of ~max-len per step
    # (a chat averages about max-len / 3.5 tokens)
    n_chats = max(2 * args.steps * args.batch_size, 5 * args.packed_steps * args.batch_size)
    chats = make_chats(n_chats, args.max_len, tok)
    data = out / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))

    lengths = [len(render_ids(tok, c["messages"])) for c in chats]
    batches = [lengths[i : i + args.batch_size] for i in range(0, len(lengths), args.batch_size)]
    padded = sum(len(b) * max(b) for b in batches) / sum(lengths)
    mean_len = statistics.mean(lengths)
    print(
        f"data: {len(chats)} chats of {min(lengths)}-{max(lengths)} tokens, {mean_len:.0f} on average; "
        f"padded batches of {args.batch_size} hold {padded:.2f}x the real tokens",
        flush=True,
    )
    # trl-packing-1row: one packed row per step, as many steps as the rlctl run's tokens fill rows
    row_steps = WARMUP_STEPS + math.ceil((args.steps - WARMUP_STEPS) * args.batch_size * mean_len / args.max_len)
    b = args.batch_size
    runs = {
        "rlctl": lambda k: rlctl_run(args, model, data, out / f"rlctl-{k}"),
        "trl": lambda k: trl_run(args, model, data, out / f"trl-{k}", batch=b, steps=args.steps, packing=False),
        "trl-packing": lambda k: trl_run(
            args,
            model,
            data,
            out / f"trl-packing-{k}",
            batch=b,
            steps=args.packed_steps,
            packing=True,
            warmup=PACKED_WARMUP_STEPS,
        ),
        "trl-packing-1row": lambda k: trl_run(
            args, model, data, out / f"trl-packing-1row-{k}", batch=1, steps=row_steps, packing=True
        ),
    }
    if args.only:
        runs = {name: run for name, run in runs.items() if name in args.only.split(",")}
    flops = flops_per_token(model, lengths)
    peak_before = fp32_peak()
    print(f"fp32 matmul peak (one thread): {peak_before / 1e9:.1f} GFLOP/s", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for k in range(args.rounds):
        for name, run in runs.items():
            t = time.perf_counter()
            results[name].append(run(k))
            r = results[name][-1]
            print(
                f"round {k + 1} {name}: {r['tokens_per_cpu_s']:,.0f} tok/CPU-s ({r['tokens_per_s']:,.0f} tok/s), "
                f"load {r['load']:.1f}, {time.perf_counter() - t:.0f} s",
                flush=True,
            )
    per_chat = {name: rs[0]["tokens_per_chat"] for name, rs in results.items() if "tokens_per_chat" in rs[0]}
    print(
        f"tokens per chat: {mean_len:.1f} as rlctl renders them (the chat template), "
        + ", ".join(f"{v:.1f} as {name} does" for name, v in per_chat.items()),
        flush=True,
    )
    peak = max(peak_before, fp32_peak())
    ceiling = peak / flops["flops_per_token"]
    print(f"\nmedian over {args.rounds} rounds (one process, one thread each):")
    print(f"  {'':17s} {'tokens/CPU-s':>13s} {'tokens/s':>10s} {'MFU':>6s}")
    med = {}
    for name, rs in results.items():
        med[name] = {key: statistics.median(r[key] for r in rs) for key in ("tokens_per_cpu_s", "tokens_per_s")}
        med[name]["mfu"] = med[name]["tokens_per_cpu_s"] / ceiling
        m = med[name]
        print(f"  {name:17s} {m['tokens_per_cpu_s']:13,.0f} {m['tokens_per_s']:10,.0f} {m['mfu']:6.1%}")
    print(
        f"  {'FLOP limit':17s} {ceiling:13,.0f}   (fp32 peak {peak / 1e9:.1f} GFLOP/s / "
        f"{flops['flops_per_token'] / 1e6:.0f} MFLOP per token)"
    )
    ratios = {}
    for other, target in (("trl", 2.5), ("trl-packing", 2.0), ("trl-packing-1row", None)):
        if "rlctl" not in med or other not in med:
            continue
        cpu = med["rlctl"]["tokens_per_cpu_s"] / med[other]["tokens_per_cpu_s"]
        wall = med["rlctl"]["tokens_per_s"] / med[other]["tokens_per_s"]
        ratios[other] = {"cpu": cpu, "wall": wall, "target": target}
        goal = f"(target >= {target}x)" if target else "(no target: not the issue's setting)"
        print(f"rlctl / {other:17s} = {cpu:.2f}x per CPU second, {wall:.2f}x per wall second  {goal}")
    if "rlctl" in med:
        m = med["rlctl"]["mfu"]
        print(f"rlctl runs at {m:.0%} of the FLOP limit: it can be 2x only a column below {m / 2:.0%} of it")
    limit = {
        **flops,
        "fp32_peak_flops": peak,
        "fp32_peak_flops_before": peak_before,
        "tokens_per_s_ceiling": ceiling,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "args": vars(args),
        "data": {"chats": len(chats), "min": min(lengths), "max": max(lengths), "mean": mean_len},
        "flop_limit": limit,
        "median": med,
        "ratios": ratios,
        "runs": results,
    }
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
