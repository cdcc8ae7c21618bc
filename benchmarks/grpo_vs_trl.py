"""Seconds per GRPO step and reward after N steps: `rlctl grpo` against TRL's GRPOTrainer, on this CPU.

    python benchmarks/grpo_vs_trl.py --model runs/demo/sft/hf [--steps 10] [--rollouts hf,vllm]

The model is the demo's SFT model (``make demo`` writes it to runs/demo/sft/hf): a tiny Qwen2 that
answers two-digit additions, so the exact-match reward is neither 0 nor 1. Both frameworks train
it on the demo's training prompts with the same settings: batch (prompts per step), n (samples per
prompt), response length, temperature 1, learning rate (constant), PPO clip 0.2, token-mean loss
(TRL's ``loss_type="dapo"``), group-normalised advantages, no KL term and no reference model, one
optimizer step per batch, the same exact-match reward function (rlctl.rewards.builtin.exact_score),
one process with one thread each. Rollouts by HF ``generate`` (rlctl ``--rollout hf``, TRL's
default) or by vLLM in the same process (rlctl ``--rollout vllm``, TRL ``use_vllm=True,
vllm_mode="colocate"``). rlctl and TRL runs alternate.

Measured from the end of step WARMUP_STEPS to the end of the last step: seconds per step by the
wall clock and by the training process's CPU time (robust when other jobs share the machine),
sampled for rlctl when its metrics.jsonl grows and for TRL in a callback. Reward: the mean
training reward of the last three steps, and the held-out accuracy (greedy, plain transformers) of
the model each run ends with.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from sft_vs_trl import WARMUP_STEPS, _env, run_rlctl_clocked

from rlctl.data import arith

LR = 1e-4
MAX_PROMPT_LEN = 32
MAX_RESPONSE_LEN = 4
LAST = 3  # training steps whose reward is averaged as "reward after N steps"


def step_times(marks: dict[int, tuple[float, float]]) -> dict:
    seen = sorted(n for n in marks if n >= WARMUP_STEPS)
    first, last = seen[0], seen[-1]
    steps = last - first
    return {
        "cpu_s_per_step": (marks[last][0] - marks[first][0]) / steps,
        "s_per_step": (marks[last][1] - marks[first][1]) / steps,
        "steps": steps,
    }


def rlctl_run(args, data: Path, out: Path, rollout: str) -> dict:
    argv = [
        sys.executable,
        "-m",
        "rlctl",
        "grpo",
        "--model",
        args.model,
        "--data",
        str(data),
        "--reward",
        "exact",
        "--device",
        "cpu",
        "--nproc",
        "1",
        "--rollout",
        rollout,
        "-o",
        str(out),
        "--max-steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--n",
        str(args.n),
        "--lr",
        str(LR),
        "--temperature",
        "1.0",
        "--max-prompt-len",
        str(MAX_PROMPT_LEN),
        "--max-response-len",
        str(MAX_RESPONSE_LEN),
        "--kl-coef",
        "0",
        "--seed",
        "0",
    ]
    marks = run_rlctl_clocked(argv, out, "grpo", out.parent / f"{out.name}.log")
    rewards = [
        json.loads(line)["reward"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"kind": "eval"' not in line
    ]
    return {**step_times(marks), "reward": statistics.mean(rewards[-LAST:]), "model": str(out / "hf")}


def trl_run(args, data: Path, out: Path, rollout: str) -> dict:
    argv = [
        sys.executable,
        __file__,
        "--trl-worker",
        "--model",
        args.model,
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        str(args.steps),
        "--batch-size",
        str(args.batch_size),
        "--n",
        str(args.n),
        "--rollout",
        rollout,
    ]
    out.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"{out.name}.log"
    with open(log_path, "w") as log:
        code = subprocess.call(
            argv, env={**_env(), "VLLM_CPU_KVCACHE_SPACE": "1"}, stdout=log, stderr=subprocess.STDOUT
        )
    if code:
        lines = [line for line in log_path.read_text().splitlines() if "Error" in line]
        return {"failed": (lines[-1].strip() if lines else f"exit code {code}") + f" (log: {log_path})"}
    return json.loads((out / "result.json").read_text())


def trl_worker(args) -> None:
    """One TRL GRPOTrainer run (in its own process); writes OUT/result.json and the model to OUT/model."""
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlctl.rewards.builtin import exact_score

    torch.set_num_threads(1)
    out = Path(args.out)
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    ds = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]
    )

    def exact(completions, answer, **kwargs):
        return [exact_score("arith", c[0]["content"], a) for c, a in zip(completions, answer)]

    marks: dict[int, tuple[float, float]] = {0: (time.process_time(), time.perf_counter())}
    rewards: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, cfg, state, *a, **k):
            marks[state.global_step] = (time.process_time(), time.perf_counter())

        def on_log(self, cfg, state, control, logs=None, **k):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.batch_size * args.n,
        num_generations=args.n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=MAX_RESPONSE_LEN,
        max_steps=args.steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        temperature=1.0,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        use_vllm=args.rollout == "vllm",
        vllm_mode="colocate",
        vllm_max_model_length=64,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=exact, args=config, train_dataset=ds, processing_class=tok, callbacks=[Clock()]
    )
    trainer.train()
    trainer.save_model(str(out / "model"))
    tok.save_pretrained(str(out / "model"))
    (out / "result.json").write_text(
        json.dumps({**step_times(marks), "reward": statistics.mean(rewards[-LAST:]), "model": str(out / "model")})
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="runs/demo/sft/hf", help="an HF model dir (default: the demo's SFT model)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per step")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--rollouts", default="hf,vllm")
    ap.add_argument("--out", default="runs/bench-grpo")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rollout", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return
    if not (Path(args.model) / "config.json").exists():
        raise SystemExit(
            f"{args.model} is not an HF model directory; run `make demo` first (it writes "
            f"runs/demo/sft/hf) or pass --model"
        )

    import shutil

    from rlctl.demo import FULL, SEED

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    train, heldout = arith.make_problems(FULL.max_operand, FULL.n_heldout, seed=SEED)
    data = arith.write_jsonl(arith.rl_rows(train), out / "rl.jsonl")
    start_acc = arith.accuracy(args.model, heldout)
    print(
        f"model {args.model}: held-out accuracy {100 * start_acc:.1f}% before training; {args.steps} steps of "
        f"{args.batch_size} prompts x {args.n} samples",
        flush=True,
    )

    rows = []
    for rollout in args.rollouts.split(","):
        res = {
            "rlctl": rlctl_run(args, data, out / f"rlctl-{rollout}", rollout),
            "trl": trl_run(args, data, out / f"trl-{rollout}", rollout),
        }
        for name, r in res.items():
            if "failed" in r:
                print(f"{rollout:5s} {name:6s} FAILED: {r['failed']}", flush=True)
                continue
            r["heldout_acc"] = arith.accuracy(r["model"], heldout)
            print(
                f"{rollout:5s} {name:6s} {r['s_per_step']:6.2f} s/step (CPU {r['cpu_s_per_step']:6.2f} s/step)  "
                f"reward (last {LAST} steps) {r['reward']:.3f}  held-out {100 * r['heldout_acc']:.1f}%",
                flush=True,
            )
        rows.append((rollout, res))
    print()
    trl_hf = dict(rows).get("hf", {}).get("trl", {"failed": "not run"})
    for rollout, res in rows:
        a, b = res["rlctl"], res["trl"]
        if "failed" in a:
            print(f"{rollout}: no ratio (rlctl failed)")
            continue
        if "failed" in b:
            if "failed" in trl_hf:
                print(f"{rollout}: no ratio (TRL failed)")
                continue
            print(f"{rollout}: TRL failed; against TRL with hf rollouts instead:")
            b = trl_hf
        print(
            f"{rollout}: rlctl/TRL step time {a['s_per_step'] / b['s_per_step']:.2f}x wall, "
            f"{a['cpu_s_per_step'] / b['cpu_s_per_step']:.2f}x CPU (target <= 0.5x); reward after {args.steps} steps "
            f"{a['reward']:.3f} vs {b['reward']:.3f}; held-out {100 * a['heldout_acc']:.1f}% vs "
            f"{100 * b['heldout_acc']:.1f}%"
        )


if __name__ == "__main__":
    main()
