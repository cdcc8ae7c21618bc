"""Trained tokens per second: `rlctl dpo` against TRL's DPOTrainer, on this CPU, interleaved.

    python benchmarks/dpo_vs_trl.py [--rounds 3] [--steps 12] [--batch-size 16] [--shape S] [--vocab V] [--json OUT]

Both train the same random Qwen2 (rlctl.testing.build_tiny_model with 4 layers of width 512, ~13M
parameters) on the same preference pairs (the answer-format task of docs/dpo.md: the chosen answer has the
``#### N`` line the rejected one lacks), in fp32, one process with one thread each, the sigmoid loss with
beta 0.1, the same learning rate and batch (``--batch-size`` pairs per optimizer step), the reference's
log-probs precomputed before training on both sides (rlctl's default; TRL's ``precompute_ref_log_probs=True``),
TRL in its conversational layout so that both render the same chat template. Two settings: the short task
(sequences of ~40 tokens, ~26 of them the prompt: fixed costs and the prompt weigh most) and ``--long``
(each response opens with ~250 tokens of worked sums, different in the chosen and the rejected one: the
model's matmuls dominate, and the prompt is a twentieth of a pair's tokens); ``--max-len`` 128 and 512 on
both sides. The runs alternate (rlctl, TRL, then TRL, rlctl, ...) so that a change in the machine's load hits
both alike.

Measured, per side and round: tokens per CPU second of the training steps, the steadier figure on a shared
machine. Each side runs twice, ``--steps`` and ``--short`` optimizer steps on the same data (the same start-up,
tokenization and reference pass: the data set is the same size), and the figure is the extra tokens over the extra
CPU seconds (user + system of the whole process tree, from ``getrusage(RUSAGE_CHILDREN)``): what the extra steps
cost, start-up and the reference pass cancelled. Tokens are every token of every chosen and rejected sequence
(prompt included), padding excluded, on both sides: rlctl's ``tokens`` in RUN/metrics.jsonl, TRL's ``num_tokens``
(its attention mask's sum). Also printed: tokens per wall second over the long run's steps after the WARMUP-th
(the wall clock stamps of rlctl's metrics records; TRL's ``on_step_end``), which the machine's load moves. The
table gives each side's median over rounds and the ratios rlctl / TRL (above 1: rlctl is faster).

``--vocab V``: the same layers with a vocabulary of V rows (the tokenizer's 512 tokens and unused rows, as a
real model's embedding is wider than its tokenizer): the LM head weighs as in a real model's (V 32768: 16.8M
of 28.0M matmul weights). Printed before the runs: the matmul FLOPs each side does per counted token
(:func:`flops`), the count the measured ratio is set against. ``--head-step REPS``: no runs; this change's
own gain in one process instead (:func:`head_step`), steadier than two runs' difference on a loaded machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 2  # steps before the measured window (first-step allocations, lazy imports)
MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)


LONG_TERMS = 35  # "a + b" terms of worked sums before a --long answer: ~250 tokens of this tokenizer


TOKENS_PER_TERM = 7  # "a + b " in this tokenizer, about
VARIED = dict(prompt=(40, 0.6), response=(120, 0.7))  # lognormal (median tokens, sigma) of --shape varied


def terms(rng: random.Random, k: int) -> str:
    return " ".join(f"{rng.randrange(100)} + {rng.randrange(100)}" for _ in range(k))


def lognormal_terms(rng: random.Random, median: int, sigma: float, cap: int) -> int:
    return min(cap, max(0, round(rng.lognormvariate(0.0, sigma) * median / TOKENS_PER_TERM)))


def pairs(n: int, seed: int = 0, *, shape: str = "short") -> list[dict]:
    """``short``: ~40-token sequences; ``long``: ~290 (~250 tokens of worked sums in each answer); ``varied``:
    prompt and each answer lognormal in length (:data:`VARIED`), drawn apart, as real preference data are."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(0, 100, 3), rng.randrange(0, 100, 7)
        s = a + b
        context, work = "", ["", ""]
        if shape == "long":
            work = [f"Working: {terms(rng, LONG_TERMS)}. " for _ in range(2)]
        elif shape == "varied":  # at most ~200 + 2 x ~250 tokens: under --max-len 512 with the chat template
            k = lognormal_terms(rng, *VARIED["prompt"], cap=28)
            context = f"Given {terms(rng, k)}: " if k else ""
            work = [f"Working: {terms(rng, lognormal_terms(rng, *VARIED['response'], cap=35))}. " for _ in range(2)]
        rows.append(
            {
                "prompt": f"{context}What is {a} + {b}?",
                "chosen": f"{work[0]}The answer is {s}. #### {s}",
                "rejected": f"{work[1]}The answer is {s}.",
            }
        )
    return rows


def positions(model: Path, data: Path, batch: int, max_len: int, seed: int = 0) -> dict:
    """Counted, not timed: per counted token (every chosen and rejected token, prompt included), the positions
    each side's forward computes. rlctl: a pair's prompt once, each answer without its unlabelled closing
    newline (rlctl.data.pref_batches.collate_shared); TRL: 2 x batch rows padded to the batch's longest (its
    DataCollator; the batches drawn in a seeded random order, as its sampler draws them)."""
    from transformers import AutoTokenizer

    from rlctl.config import build_config, dotted_to_nested
    from rlctl.data.pref_batches import answer_end, shared_prompt
    from rlctl.data.preference import build_pref_data

    cfg = build_config("dpo", [dotted_to_nested({"model.name": str(model), "data.path": str(data),
                                                 "train.max_len": max_len, "data.val_fraction": 0.0})])  # fmt: skip
    units = build_pref_data(cfg, AutoTokenizer.from_pretrained(str(model)), paired=True, loss="sigmoid").train
    counted = sum(len(u) for u in units)
    ours = sum(sum(answer_end(s) for s in u.seqs) - shared_prompt(u.seqs) for u in units)
    order = list(range(len(units)))
    random.Random(seed).shuffle(order)
    theirs = sum(
        2 * len(b) * max(len(s) for i in b for s in units[i].seqs)
        for b in (order[k : k + batch] for k in range(0, len(order), batch))
    )
    labelled = sum(s.num_loss_tokens for u in units for s in u.seqs)
    return {
        "tokens_per_pair": counted / len(units), "rlctl": ours / counted, "trl": theirs / counted,
        "labelled": labelled / counted,
    }  # fmt: skip


def widen_vocab(model: Path, vocab: int) -> None:
    """The model at ``model`` rebuilt with ``vocab`` rows of embedding and LM head (the same seed and layers)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model))
    config.vocab_size = vocab
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(model))


def flops(pos: dict, vocab: int) -> dict:
    """Counted matmul MFLOP per counted token (6 per weight per position for a forward and backward). rlctl:
    the layers at every position it computes, the LM head at the labelled ones only (``keep_cols``,
    rlctl.data.packing.labelled_columns). TRL 1.16 on CPU: the layers x4/3 (gradient checkpointing: a
    second forward of them), and its chunked LM head (trl.kernels.chunked_logprob) at every position of the
    padded batch (it keeps only the labelled ones where Triton runs: CUDA, XPU) with 8 per weight (its backward
    recomputes each tile of logits). Attention's score products are left out (under 10% at these lengths)."""
    heads, kv = MODEL["num_attention_heads"], MODEL["num_key_value_heads"]
    h, f = MODEL["hidden_size"], MODEL["intermediate_size"]
    layers = MODEL["num_hidden_layers"] * (2 * h * h + 2 * h * (h * kv // heads) + 3 * h * f)
    head = h * vocab
    return {
        "rlctl": 6 * (layers * pos["rlctl"] + head * pos["labelled"]) / 1e6,
        "rlctl_head_everywhere": 6 * (layers + head) * pos["rlctl"] / 1e6,
        "trl": (6 * layers * 4 / 3 + 8 * head) * pos["trl"] / 1e6,
        "head_share": head / (layers + head),
    }


def head_step(model: Path, data: Path, batch: int, max_len: int, reps: int) -> dict:
    """In this process, one thread: a step's micro-batch (``batch`` pairs packed in one row, prompts shared, as
    rlctl's packing holds them) through a forward and backward of the summed log-probs, the LM head at the
    labelled columns only (``keep_cols``, what rlctl dpo runs) against every column (before), alternating;
    CPU seconds per pass, median over ``reps``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlctl.config import build_config, dotted_to_nested
    from rlctl.data.pref_batches import unit_micro_batches
    from rlctl.data.preference import build_pref_data
    from rlctl.engines import varlen
    from rlctl.recipes.dpo import sequence_logps

    torch.set_num_threads(1)
    cfg = build_config("dpo", [dotted_to_nested({"model.name": str(model), "data.path": str(data),
                                                 "train.max_len": max_len, "data.val_fraction": 0.0})])  # fmt: skip
    tok = AutoTokenizer.from_pretrained(str(model))
    units = build_pref_data(cfg, tok, paired=True, loss="sigmoid").train[:batch]
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32, attn_implementation="sdpa")
    varlen.install(hf.config)

    def one(keep: bool) -> float:
        (mb,) = unit_micro_batches(units, 0, 1, packing=True, budget=10**7, pad_id=tok.pad_token_id,
                                   per_micro=batch, share_prompt=True, keep_labelled=keep)  # fmt: skip
        kwargs = varlen.attention_kwargs(mb.blocks, mb.input_ids)
        if keep:
            kwargs["logits_to_keep"] = mb.keep_cols
        start = time.process_time()
        out = hf(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False, **kwargs).logits
        sequence_logps(out, mb).sum().backward()
        hf.zero_grad()
        return time.process_time() - start

    one(True), one(False)  # warm-up
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(reps):
        for keep in (True, False) if r % 2 == 0 else (False, True):
            times[keep].append(one(keep))
    tokens = sum(len(u) for u in units)
    med = {keep: statistics.median(t) for keep, t in times.items()}
    return {"tokens": tokens, "cpu_s_every_column": med[False], "cpu_s_labelled": med[True],
            "speedup": med[False] / med[True], "times": {str(k): v for k, v in times.items()}}  # fmt: skip


def matmul_gflops(m: int = 1024, k: int = 512, n: int = 1408, reps: int = 20) -> float:
    """This process's fp32 matmul throughput on one thread, GFLOP per CPU second (a shape of the model's MLP)."""
    import torch

    torch.set_num_threads(1)
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    start = time.process_time()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.process_time() - start) / 1e9


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def window(stamps: list[float], tokens: list[int]) -> float:
    """Tokens per wall second from the end of step WARMUP to the end of the last step."""
    return sum(tokens[WARMUP:]) / (stamps[-1] - stamps[WARMUP - 1])


def cpu_seconds(cmd: list[str], extra_env: dict | None = None) -> float:
    """Run ``cmd`` to the end; the user + system CPU seconds of it and every process it waited for."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, env={**env(), **(extra_env or {})}, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def rlctl_run(model: Path, data: Path, work: Path, steps: int, batch: int, max_len: int, checkout: str = "") -> tuple:
    """``checkout``: rlctl from that source tree instead (its root first on PYTHONPATH: ``--base``)."""
    run = work / f"rlctl-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "rlctl", "dpo", "--model", str(model), "--data", str(data), "--device", "cpu",
           "--nproc", "1", "--batch-size", str(batch), "--max-len", str(max_len), "--max-steps", str(steps),
           "--lr", "1e-4",
           "-o", str(run), "--set", "checkpoint.export_hf=false", "--set", "checkpoint.save_every=0"]  # fmt: skip
    cpu = cpu_seconds(cmd, {"PYTHONPATH": f"{checkout}:{os.environ.get('PYTHONPATH', '')}"} if checkout else {})
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps_ = [r for r in records if r.get("kind") != "eval" and "tokens" in r]
    return cpu, [r["time"] for r in steps_], [r["tokens"] for r in steps_]


def trl_run(model: Path, data: Path, work: Path, steps: int, batch: int, max_len: int) -> tuple:
    out = work / f"trl-{time.monotonic_ns()}.json"
    cpu = cpu_seconds(
        [
            sys.executable,
            __file__,
            "--trl-worker",
            str(model),
            str(data),
            str(steps),
            str(batch),
            str(out),
            str(max_len),
        ]
    )
    doc = json.loads(out.read_text())
    return cpu, doc["stamps"], doc["tokens"]


def measure(run, model: Path, data: Path, work: Path, a) -> dict:
    """Both runs of one side: tokens per marginal CPU second, and the long run's tokens per wall second."""
    cpu_long, stamps, tokens = run(model, data, work, a.steps, a.batch_size, a.max_len)
    cpu_short, _, tokens_short = run(model, data, work, a.short, a.batch_size, a.max_len)
    return {
        "tokens_per_cpu_s": (sum(tokens) - sum(tokens_short)) / (cpu_long - cpu_short),
        "tokens_per_s": window(stamps, tokens),
        "load": os.getloadavg()[0],
        "matmul_gflops": matmul_gflops(),
    }


def trl_worker(model_dir: str, data: str, steps: str, batch: str, out: str, max_len: str) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    rows = [json.loads(line) for line in open(data)]
    conv = [
        {"prompt": [{"role": "user", "content": r["prompt"]}],
         "chosen": [{"role": "assistant", "content": r["chosen"]}],
         "rejected": [{"role": "assistant", "content": r["rejected"]}]}
        for r in rows
    ]  # fmt: skip
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.time())

    args = DPOConfig(
        output_dir=str(Path(out).parent / "trl-out"), per_device_train_batch_size=int(batch), max_steps=int(steps),
        learning_rate=1e-4, logging_steps=1, report_to=[], use_cpu=True, max_length=int(max_len), bf16=False,
        save_strategy="no", beta=0.1, precompute_ref_log_probs=True, dataloader_num_workers=0,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(conv), processing_class=tok, callbacks=[Stamp()]
    )
    trainer.train()
    seen = [log["num_tokens"] for log in trainer.state.log_history if "num_tokens" in log and "loss" in log]
    tokens = [int(b - a) for a, b in zip([0.0] + seen[:-1], seen)]
    Path(out).write_text(json.dumps({"stamps": stamps, "tokens": tokens}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--short", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shape", choices=["short", "long", "varied"], default="short", help="the pairs' lengths")
    p.add_argument("--vocab", type=int, default=512, help="the model's vocabulary rows (the tokenizer: 512)")
    p.add_argument("--base", default="", help="also time rlctl from this source tree (e.g. the commit before a change)")
    p.add_argument("--head-step", type=int, default=0, metavar="REPS",
                   help="time REPS forward+backward passes of a step in this process, the LM head at the labelled "
                   "columns only against every column (head_step); no runs")  # fmt: skip
    p.add_argument("--json", default="")
    p.add_argument("--count-only", action="store_true", help="print the positions each side computes; no runs")
    a = p.parse_args()
    a.max_len = 128 if a.shape == "short" else 512
    from rlctl.testing import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="dpo-vs-trl-"))
    model = build_tiny_model(work / "model", seed=0, **MODEL)
    if a.vocab != 512:
        widen_vocab(model, a.vocab)
    data = work / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs(a.steps * a.batch_size, shape=a.shape)))
    pos = positions(model, data, a.batch_size, a.max_len)
    print(f"{pos['tokens_per_pair']:.0f} tokens per pair; positions computed per token: rlctl {pos['rlctl']:.3f}, "
          f"TRL {pos['trl']:.3f} (x4/3 for its gradient checkpointing); labelled {pos['labelled']:.3f}")  # fmt: skip
    fl = flops(pos, a.vocab)
    print(f"vocabulary {a.vocab} (LM head {fl['head_share']:.1%} of the matmul weights); counted MFLOP per token: "
          f"rlctl {fl['rlctl']:.1f} (head everywhere: {fl['rlctl_head_everywhere']:.1f}), TRL {fl['trl']:.1f}, "
          f"ratio x{fl['trl'] / fl['rlctl']:.2f} (head everywhere: x{fl['trl'] / fl['rlctl_head_everywhere']:.2f})",
          flush=True)  # fmt: skip
    if a.head_step:
        h = head_step(model, data, a.batch_size, a.max_len, a.head_step)
        counted = fl["rlctl_head_everywhere"] / fl["rlctl"]
        print(f"a step's forward+backward ({h['tokens']} tokens), CPU s: LM head at every column "
              f"{h['cpu_s_every_column']:.3f}, at the labelled columns {h['cpu_s_labelled']:.3f}: x{h['speedup']:.2f} "
              f"(counted x{counted:.2f}; load average {os.getloadavg()[0]:.2f})")  # fmt: skip
        if a.json:
            Path(a.json).write_text(
                json.dumps({"head_step": h, "positions": pos, "flops": fl, "settings": vars(a)}, indent=2) + "\n"
            )
        return
    if a.count_only:
        return
    sides = {"rlctl": rlctl_run, "trl": trl_run}
    if a.base:
        sides["base"] = lambda *args: rlctl_run(*args, checkout=str(Path(a.base).resolve()))
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for k in range(a.rounds):
        order = list(sides)[k % len(sides) :] + list(sides)[: k % len(sides)]
        for side in order if k % 2 == 0 else order[::-1]:
            m = measure(sides[side], model, data, work, a)
            runs[side].append(m)
            print(
                f"round {k + 1} {side}: {m['tokens_per_cpu_s']:,.0f} tokens per CPU s, {m['tokens_per_s']:,.0f} "
                f"tokens/s (load average {m['load']:.2f}, matmul {m['matmul_gflops']:.1f} GFLOP per CPU s)",
                flush=True,
            )
    med = {
        side: {k: statistics.median(r[k] for r in v) for k in ("tokens_per_cpu_s", "tokens_per_s")}
        for side, v in runs.items()
    }
    ratio = {k: med["rlctl"][k] / med["trl"][k] for k in ("tokens_per_cpu_s", "tokens_per_s")}
    for k in ratio:
        print(f"median {k}: rlctl {med['rlctl'][k]:,.0f}, trl {med['trl'][k]:,.0f}, rlctl / trl {ratio[k]:.2f}")
        if a.base:
            print(f"  base {med['base'][k]:,.0f}, rlctl / base {med['rlctl'][k] / med['base'][k]:.2f}")
    if a.json:
        doc = {"runs": runs, "median": med, "ratio": ratio, "positions": pos, "flops": fl, "settings": vars(a),
               "model": MODEL}  # fmt: skip
        Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--trl-worker":
        trl_worker(*sys.argv[2:8])
    else:
        main()
