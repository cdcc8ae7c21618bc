"""Trained tokens per second: `rlctl sft` against TRL's SFTTrainer, on this CPU.

    python benchmarks/sft_vs_trl.py [--rounds 3] [--steps 12] [--batch-size 8] [--max-len 1024]

Both train the same tiny Qwen2 model (rlctl.testing.build_tiny_model) on the same chats (lengths
spread from a few dozen tokens to max-len, as in real SFT data), with the same sequence length,
batch size (conversations per step), learning rate, loss on the assistant tokens only, no
activation checkpointing, one process with one thread each. The runs are interleaved (rlctl, TRL,
TRL with packing, then again) so that a change in the machine's load hits all of them alike.

Measured: real (non-padding) tokens trained per second of optimizer steps, from each framework's
own per-step timing, skipping the first steps (warm-up). For rlctl: ``tokens`` and
``step_time_s`` of RUN/metrics.jsonl. For TRL: a callback times each step (on_step_begin to
on_step_end, which leaves TRL's data collation outside the timing) and the trainer counts the
non-padding tokens of the inputs it trains on.

TRL is run twice: with its defaults (padded batches) and with ``packing=True`` (best-fit-decreasing
packing, padding free, one packed row of max-len tokens per step), so the table shows both what
packing buys and what is left. rlctl runs its default plan (no speed flag): packed rows whose
attention is split per document (rlctl.engines.varlen), so a long row costs the sum of its
documents' squared lengths, not the row's square. The load average is recorded with each run and
the raw figures go to --json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARMUP_STEPS = 2  # steps left out of the throughput (first-call allocations, lazy inits)
PACKED_ROWS_PER_BATCH = 3  # a batch of 8 chats (~190 tokens each) fills about 3 rows of 512
WORDS = (
    "the",
    "model",
    "learns",
    "to",
    "answer",
    "questions",
    "about",
    "numbers",
    "words",
    "and",
    "tokens",
    "with",
    "short",
    "and",
    "long",
    "replies",
    "while",
    "the",
    "trainer",
    "packs",
    "sequences",
    "into",
    "batches",
    "on",
    "a",
    "small",
    "processor",
)


def make_chats(n: int, max_len: int, tokenizer, seed: int = 0) -> list[dict]:
    """``n`` chats whose rendered length (chat template included) is log-uniform between 32 and
    ``max_len`` tokens, like real SFT data: many short replies, a few long ones."""
    rng = random.Random(seed)
    chats = []
    while len(chats) < n:
        user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16)))
        target = int(2 ** rng.uniform(5, math.log2(max_len)))
        words = tokenizer(" ".join(rng.choice(WORDS) for _ in range(max_len)), add_special_tokens=False)["input_ids"]
        prompt_len = len(_render(tokenizer, [{"role": "user", "content": user}], add_generation_prompt=True))
        reply = tokenizer.decode(words[: max(2, target - prompt_len - 2)]).strip()
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        if len(_render(tokenizer, messages)) <= max_len:
            chats.append({"messages": messages})
    return chats


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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


def measured(marks: dict[int, tuple[float, float]], step_tokens: list[float]) -> dict:
    """Tokens per CPU second and per wall second from the end of step WARMUP_STEPS (or the first
    step seen after it) to the end of the last step."""
    seen = sorted(n for n in marks if n >= WARMUP_STEPS)
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
    return {**measured(marks, [r["tokens"] for r in records if r.get("kind") != "eval"]), "load": load}


def trl_run(args, model: Path, data: Path, out: Path, packing: bool) -> dict:
    # Packed, TRL turns a batch of B rows into ONE padding-free row of B x max-len tokens, whose sdpa
    # attention is quadratic in that length; one packed row per step (max-len tokens, about as many
    # tokens as a padded step holds) is its fast setting, with the steps scaled to the same token budget.
    batch, steps = (1, args.steps * PACKED_ROWS_PER_BATCH) if packing else (args.batch_size, args.steps)
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
    ]
    if packing:
        argv.append("--packing")
    out.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    with open(out.parent / f"{out.name}.log", "w") as log:
        subprocess.run(argv, check=True, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    return {**json.loads((out / "result.json").read_text()), "load": load}


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

    class Clock(TrainerCallback):
        def on_step_end(self, cfg, state, *a, **k):
            marks[state.global_step] = (time.process_time(), time.perf_counter())
            step_tokens.append(0)

    class CountingTrainer(SFTTrainer):
        def training_step(self, model, inputs, *a, **k):
            step_tokens[-1] += int((inputs["input_ids"] != tok.pad_token_id).sum())
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
    trainer.train()
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(measured(marks, step_tokens)))


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=512, help="model width (heads of 64)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default="runs/bench-sft")
    ap.add_argument("--json", default="benchmarks/results/speed/sft-vs-trl.json")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--packing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return

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
    chats = make_chats(args.steps * args.batch_size * 2, args.max_len, tok)
    data = out / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats))

    lengths = [len(_render(tok, c["messages"])) for c in chats]
    batches = [lengths[i : i + args.batch_size] for i in range(0, len(lengths), args.batch_size)]
    padded = sum(len(b) * max(b) for b in batches) / sum(lengths)
    print(
        f"data: {len(chats)} chats, {statistics.mean(lengths):.0f} tokens on average (max {max(lengths)}); "
        f"padded batches of {args.batch_size} hold {padded:.2f}x the real tokens",
        flush=True,
    )
    runs = {
        "rlctl": lambda k: rlctl_run(args, model, data, out / f"rlctl-{k}"),
        "trl": lambda k: trl_run(args, model, data, out / f"trl-{k}", packing=False),
        "trl-packing": lambda k: trl_run(args, model, data, out / f"trl-packing-{k}", packing=True),
    }
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for k in range(args.rounds):
        for name, run in runs.items():
            results[name].append(run(k))
        print(
            f"round {k + 1}: "
            + ", ".join(
                f"{name} {r[-1]['tokens_per_cpu_s']:,.0f} tok/cpu-s ({r[-1]['tokens_per_s']:,.0f} tok/s)"
                for name, r in results.items()
            ),
            flush=True,
        )
    print(f"\nmedian over {args.rounds} rounds (one process, one thread each):")
    print(f"  {'':12s} {'tokens/CPU-s':>13s} {'tokens/s':>10s}")
    med = {}
    for name, rs in results.items():
        med[name] = {key: statistics.median(r[key] for r in rs) for key in ("tokens_per_cpu_s", "tokens_per_s")}
        print(f"  {name:12s} {med[name]['tokens_per_cpu_s']:13,.0f} {med[name]['tokens_per_s']:10,.0f}")
    ratios = {}
    for other, target in (("trl", 2.5), ("trl-packing", 2.0)):
        cpu = med["rlctl"]["tokens_per_cpu_s"] / med[other]["tokens_per_cpu_s"]
        wall = med["rlctl"]["tokens_per_s"] / med[other]["tokens_per_s"]
        ratios[other] = {"cpu": cpu, "wall": wall, "target": target}
        print(f"rlctl / {other:12s} = {cpu:.2f}x per CPU second, {wall:.2f}x per wall second  (target >= {target}x)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"args": vars(args), "median": med, "ratios": ratios, "runs": results}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
