"""Reverse KL to the teacher per training sample: on-policy distillation (`rlctl grpo --teacher`) against SFT on
the teacher's own samples (`rlctl sft`), on this CPU.

    python benchmarks/distill_vs_sft.py [--steps 16] [--lrs 1e-3,3e-3,1e-2] [--seeds 0,1] [--nproc 2]
        [--methods distill,sft] [--warm-steps N] [--out DIR] [--json OUT]

The setup of docs/distill.md's CPU example: a random student with a 128-token vocabulary
(rlctl.testing.build_tiny_model) and a teacher trained from it by `rlctl sft` to answer "What is a + b?" with
"The answer is N.". Then, from the same student, with the same samples per step (4 prompts x 8 samples, 12
tokens at most), learning rate and steps, 2 processes each:

- distill: `rlctl grpo --teacher`, the student samples and the teacher scores every token;
- sft: `rlctl sft` on 8 responses the teacher samples (temperature 1, 12 tokens at most, plain transformers) to
  each training prompt, 32 sequences per optimizer step (the teacher's decoded text, re-tokenized).

Measured after each run: the reverse KL KL(student || teacher) on 6 held-out prompts (the full vocabulary's KL at
each token the student samples: 4 samples of 12 tokens per prompt, temperature 1, the same seed), and before
training. Lower after the same number of samples is better. Each method runs at every ``--lrs`` with every
``--seeds`` (``train.seed``, and the teacher samples SFT gets, the same for both methods); the table is the
median over seeds per learning rate, and each method's best learning rate. ``--methods distill_baseline``:
distillation with ``algo.teacher_baseline`` (the gap against the batch's mean); ``distill_full``: with
``algo.distill=full`` (the exact reverse KL over the vocabulary at each sampled position, as the loss).
``--warm-steps N``: both start from the student after N SFT steps on other teacher samples. Results and
commands: docs/distill.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import torch

# --task: "answer" (the teacher answers "The answer is N.": 12 characters sampled, near-deterministic) or "long"
# (the teacher writes "N:" then 8 words drawn at random from 6, 4 such answers per prompt: 40 characters sampled,
# an uncertain choice at every word boundary, so the student's own states drift from the teacher's)
TASK = {"answer": {"resp": 12, "max_len": "64"}, "long": {"resp": 40, "max_len": "128"}}
WORDS = ("red", "blue", "green", "cat", "dog", "sun")
RESP = {"len": 12, "max_len": "64", "task": "answer"}

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def rlctl(*args: str) -> None:
    res = subprocess.run([sys.executable, "-m", "rlctl", *args], env=ENV, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"rlctl {args[0]} failed:\n{res.stderr[-3000:]}")


def sums(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randrange(0, 100, 3), rng.randrange(0, 100, 7)) for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir)), AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()


def sample(tok, model, text: str, k: int, seed: int) -> tuple[torch.Tensor, int]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            ids.repeat(k, 1),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=RESP["len"],
            pad_token_id=tok.pad_token_id,
        )
    return out, ids.shape[1]


def reverse_kl(student_dir: Path, teacher_dir: Path, prompts: list[str]) -> float:
    """Mean per-token KL(student || teacher) over the vocabulary, along the student's samples."""
    tok, s = load(student_dir)
    _, t = load(teacher_dir)
    total, count = 0.0, 0
    for i, text in enumerate(prompts):
        out, n = sample(tok, s, text, 4, seed=i)
        with torch.no_grad():
            ls = s(out).logits[:, n - 1 : -1].log_softmax(-1)
            lt = t(out).logits[:, n - 1 : -1].log_softmax(-1)
        sampled = out[:, n:] != tok.pad_token_id
        total += float(((ls.exp() * (ls - lt)).sum(-1) * sampled).sum())
        count += int(sampled.sum())
    return total / count


def make_teacher(out: Path, student: Path, train: list[tuple[int, int]]) -> Path:
    answers = [{"prompt": f"What is {x} + {y}?", "response": f"The answer is {x + y}."} for x, y in train]
    if RESP["task"] == "long":
        rng = random.Random(5)
        answers = [
            {"prompt": f"What is {x} + {y}?", "response": f"{x + y}: " + " ".join(rng.choices(WORDS, k=8))}
            for x, y in train
            for _ in range(4)
        ]
    rlctl("sft", "--model", str(student), "--data", str(write_jsonl(out / "answers.jsonl", answers)),
          "--device", "cpu", "--nproc", "2", "--batch-size", "16", "--lr", "3e-3", "--max-steps", "40",
          "--max-len", RESP["max_len"], "-o", str(out / "teacher"))  # fmt: skip
    return out / "teacher" / "hf"


def teacher_samples(teacher: Path, prompts: list[dict], seed: int) -> list[dict]:
    """8 teacher samples per training prompt (temperature 1), decoded: SFT's data."""
    tok, tm = load(teacher)
    rows = []
    for i, r in enumerate(prompts):
        seqs, n = sample(tok, tm, r["prompt"], 8, seed=1000 * seed + 100 + i)
        rows += [{"prompt": r["prompt"], "response": tok.decode(s[n:], skip_special_tokens=True)} for s in seqs]
    return rows


# distill_baseline: --set algo.teacher_baseline=true; distill_full: --set algo.distill=full (the exact reverse KL
# over the vocabulary at each sampled position, as the loss); _fwd: the forward KL instead (algo.distill_beta=0);
# _mix: GKD's mixture, half the steps on SFT's teacher samples (--teacher-data, algo.teacher_data_fraction 0.5);
# _warmup: the first WARMUP steps on them, then the student's own samples (fraction 0); _kd: every step on them with
# the forward KL (supervised KD, nothing sampled: the mixture's ablation)
FULL = ["--set", "algo.distill=full"]
MIX, FWD = ["--teacher-data", "{samples}"], ["--set", "algo.distill_beta=0"]
WARMUP = 4
EXTRA = {
    "distill_baseline": ["--set", "algo.teacher_baseline=true"],
    "distill_full": FULL,
    "distill_full_fwd": FULL + FWD,
    "distill_full_mix": FULL + MIX,
    "distill_full_mix_fwd": FULL + MIX + FWD,
    "distill_full_kd": FULL + MIX + FWD + ["--set", "algo.teacher_data_fraction=1"],  # every step on them: no sampling
    "distill_full_warmup": FULL
    + MIX
    + ["--set", "algo.teacher_data_fraction=0", "--set", f"algo.teacher_data_warmup={WARMUP}"],
}
METHODS = ("distill", *EXTRA, "sft")


def train_methods(out: Path, student: Path, teacher: Path, prompts: list[dict], lr: str, seed: int, a) -> dict:
    """The ``--methods`` runs from the student at ``lr`` with ``seed`` (their sampling, data order and the
    teacher's samples); their directories."""
    run = out / f"lr{lr}-seed{seed}"
    run.mkdir(parents=True, exist_ok=True)
    common = ["--model", str(student), "--device", "cpu", "--nproc", str(a.nproc), "--lr", lr,
              "--max-steps", str(a.steps), "--set", f"train.seed={seed}"]  # fmt: skip
    dirs = {}
    samples = run / "teacher_samples.jsonl"  # SFT's data, and the mixture's teacher data
    if any(m == "sft" or "--teacher-data" in EXTRA.get(m, []) for m in a.methods):
        write_jsonl(samples, teacher_samples(teacher, prompts, seed))
    for method in a.methods:
        if method == "sft":
            rlctl("sft", *common, "--data", str(samples), "--batch-size", "32", "--max-len", RESP["max_len"],
                  "-o", str(run / method))  # fmt: skip
        else:
            extra = [x.format(samples=samples) for x in EXTRA.get(method, [])]
            rlctl("grpo", *common, *extra, "--teacher", str(teacher), "--data",
                  str(write_jsonl(run / "prompts.jsonl", prompts)), "--reward", "gsm8k", "--rollout", "hf",
                  "--batch-size", "4", "--n", "8", "--max-prompt-len", "48", "--max-response-len", str(RESP["len"]),
                  "-o", str(run / method))  # fmt: skip
        dirs[method] = run / method / "hf"
    return dirs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="comma-separated: each method at each")
    p.add_argument("--seeds", default="0", help="comma-separated train.seed values, the same for both methods")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--warm-steps",
        type=int,
        default=0,
        help="first this many SFT steps (lr 3e-3) on teacher "
        "samples: both methods start from that student (on-policy distillation's usual start)",
    )
    p.add_argument("--methods", default="distill,sft", help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--task", choices=sorted(TASK), default="answer", help="the teacher's task (see TASK)")
    p.add_argument("--out", type=Path, default=Path("/tmp/distill_vs_sft"))
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    a.methods = a.methods.split(",")
    RESP.update(len=TASK[a.task]["resp"], max_len=TASK[a.task]["max_len"], task=a.task)
    if set(a.methods) - set(METHODS):
        raise SystemExit(f"--methods: each of {', '.join(METHODS)}")
    from rlctl.testing import build_tiny_model

    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    student = build_tiny_model(out / "student", vocab_size=128)
    train = sums(64, 0)
    held_out = [f"What is {x} + {y}?" for x, y in sums(6, 7)]
    prompts = [{"prompt": f"What is {x} + {y}?", "answer": str(x + y)} for x, y in train]
    teacher = make_teacher(out, student, train)
    if a.warm_steps:
        data = write_jsonl(out / "warm_samples.jsonl", teacher_samples(teacher, prompts, seed=99))
        rlctl("sft", "--model", str(student), "--data", str(data), "--device", "cpu", "--nproc", str(a.nproc),
              "--lr", "3e-3", "--max-steps", str(a.warm_steps), "--batch-size", "32", "--max-len", RESP["max_len"],
              "-o", str(out / "warm"))  # fmt: skip
        student = out / "warm" / "hf"
    result: dict = {"samples_seen": a.steps * 32, "before": reverse_kl(student, teacher, held_out), "runs": []}
    print(f"reverse KL to the teacher on {len(held_out)} held-out prompts, before: {result['before']:.3f}", flush=True)
    for seed in [int(x) for x in a.seeds.split(",")]:
        for lr in a.lrs.split(","):
            dirs = train_methods(out, student, teacher, prompts, lr, seed, a)
            row = {"lr": lr, "seed": seed, **{k: reverse_kl(d, teacher, held_out) for k, d in dirs.items()}}
            result["runs"].append(row)
            got = ", ".join(f"{k} {row[k]:.3f}" for k in a.methods)
            print(f"lr {lr} seed {seed}: {got} (load average {os.getloadavg()[0]:.1f})", flush=True)
    result["median"] = {
        lr: {k: statistics.median(r[k] for r in result["runs"] if r["lr"] == lr) for k in a.methods}
        for lr in a.lrs.split(",")
    }
    for k in a.methods:
        best = min(result["median"], key=lambda lr: result["median"][lr][k])
        result[f"best_{k}"] = {"lr": best, "reverse_kl": result["median"][best][k]}
        print(f"{k}: best median {result['median'][best][k]:.3f} at lr {best}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
