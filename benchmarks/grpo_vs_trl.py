"""Seconds per GRPO step and reward gain: `rlctl grpo` against TRL's GRPOTrainer, on this CPU, in three regimes.

    python benchmarks/grpo_vs_trl.py [--regimes overhead,compute,prompt] [--rounds 3] [--steps 8]

Regimes (the issue's): ``overhead``: a tiny Qwen2 (hidden 128, 2 layers), short prompts, 2 prompts x 4
samples x 32 tokens; ``compute``: a ~23M-parameter Qwen2 (hidden 512, 8 layers), short prompts
(~15 tokens), 2 prompts x 8 samples x 64 tokens; ``prompt``: the same model, few-shot prompts of
~180 tokens, 2 prompts x 8 samples x 32 tokens. Models have random weights (rlctl.testing), so the
responses run to the length budget in both frameworks; the reward is :func:`speed_reward.digits`
(the share of digits and spaces in the response: a signal a random model can climb).

Both frameworks run with the same settings: batch (prompts per step), n, response length,
temperature 1, learning rate (constant), PPO clip 0.2, token-mean loss (TRL's ``loss_type="dapo"``),
group-normalised advantages, no KL term and no reference model, one optimizer step per batch, hf
rollouts (``generate``), one process with one thread each, each framework with its defaults
otherwise (rlctl: the plan's; no speed flag). Runs alternate (rlctl, TRL, rlctl, TRL...) and the
ratio is the median over rounds, so a change in the machine's load hits both alike; the load
average is recorded with each run.

Measured from the end of step WARMUP_STEPS to the end of the last step: seconds per step by the wall
clock and by the training process's CPU time (robust when other jobs share the machine), sampled for
rlctl when its metrics.jsonl grows and for TRL in a callback. Reward gain per step: the least-squares
slope of the mean training reward over the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from sft_vs_trl import WARMUP_STEPS, _env, run_rlctl_clocked

LR = 1e-4
REWARD = str(Path(__file__).with_name("speed_reward.py")) + ":digits"


@dataclass(frozen=True)
class Regime:
    hidden: int
    layers: int
    batch: int  # prompts per step
    n: int  # samples per prompt
    response_len: int
    shots: int  # solved examples before the question (0: a short prompt)
    max_prompt_len: int


REGIMES = {
    "overhead": Regime(hidden=128, layers=2, batch=2, n=4, response_len=32, shots=0, max_prompt_len=64),
    "compute": Regime(hidden=512, layers=8, batch=2, n=8, response_len=64, shots=0, max_prompt_len=64),
    "prompt": Regime(hidden=512, layers=8, batch=2, n=8, response_len=32, shots=24, max_prompt_len=320),
}


def write_prompts(path: Path, shots: int, count: int = 64, seed: int = 0) -> Path:
    """Addition questions, each after ``shots`` solved ones (few-shot prompts share no text but the format)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        solved = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(shots)]
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        text = "".join(f"{x} + {y} = {x + y}. " for x, y in solved) + f"What is {a} + {b}?"
        rows.append({"prompt": text, "answer": str(a + b)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def slope(values: list[float]) -> float:
    """Least-squares slope of ``values`` over their index (reward gain per step)."""
    n = len(values)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, statistics.mean(values)
    return sum((i - mx) * (v - my) for i, v in enumerate(values)) / sum((i - mx) ** 2 for i in range(n))


def step_times(marks: dict[int, tuple[float, float]]) -> dict:
    seen = sorted(n for n in marks if n >= WARMUP_STEPS)
    first, last = seen[0], seen[-1]
    steps = last - first
    return {
        "cpu_s_per_step": (marks[last][0] - marks[first][0]) / steps,
        "s_per_step": (marks[last][1] - marks[first][1]) / steps,
        "steps": steps,
    }


def rlctl_run(args, r: Regime, model: Path, data: Path, out: Path) -> dict:
    argv = [sys.executable, "-m", "rlctl", "grpo", "--model", str(model), "--data", str(data)]
    argv += ["--reward", REWARD, "--device", "cpu", "--nproc", "1", "--rollout", "hf", "-o", str(out)]
    argv += ["--max-steps", str(args.steps), "--batch-size", str(r.batch), "--n", str(r.n), "--lr", str(LR)]
    argv += ["--temperature", "1.0", "--max-prompt-len", str(r.max_prompt_len)]
    argv += ["--max-response-len", str(r.response_len), "--kl-coef", "0", "--seed", "0"]
    argv += ["--set", "checkpoint.export_hf=false"]
    load = os.getloadavg()[0]
    marks = run_rlctl_clocked(argv, out, "grpo", out.parent / f"{out.name}.log")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [x["reward"] for x in records if x.get("kind") != "eval"]
    times = {k: statistics.mean(x.get(k, 0.0) for x in records[WARMUP_STEPS:]) for k in records[-1] if "time/" in k}
    return {**step_times(marks), "rewards": rewards, "gain_per_step": slope(rewards), "load": load, "phases": times}


def trl_run(args, r: Regime, model: Path, data: Path, out: Path) -> dict:
    argv = [sys.executable, __file__, "--trl-worker", "--model", str(model), "--data", str(data), "--out", str(out)]
    argv += ["--steps", str(args.steps), "--regime-json", json.dumps(asdict(r))]
    out.mkdir(parents=True, exist_ok=True)
    log_path = out.parent / f"{out.name}.log"
    load = os.getloadavg()[0]
    with open(log_path, "w") as log:
        code = subprocess.call(argv, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    if code:
        lines = [line for line in log_path.read_text().splitlines() if "Error" in line]
        return {"failed": (lines[-1].strip() if lines else f"exit code {code}") + f" (log: {log_path})"}
    res = json.loads((out / "result.json").read_text())
    return {**res, "gain_per_step": slope(res["rewards"]), "load": load}


def trl_worker(args) -> None:
    """One TRL GRPOTrainer run (in its own process); writes OUT/result.json."""
    import time

    import torch
    from datasets import Dataset
    from speed_reward import digits
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    r = Regime(**json.loads(args.regime_json))
    torch.set_num_threads(1)
    out = Path(args.out)
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": x["prompt"]}]} for x in rows])

    def reward(completions, **kwargs):
        return [digits("", c[0]["content"], None) for c in completions]

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
        per_device_train_batch_size=r.batch * r.n,
        num_generations=r.n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=r.response_len,
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
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=ds, processing_class=tok, callbacks=[Clock()]
    )
    trainer.train()
    (out / "result.json").write_text(json.dumps({**step_times(marks), "rewards": rewards}))


def build_models(out: Path, names: list[str]) -> dict[str, tuple[Path, Path]]:
    from rlctl.testing import build_tiny_model

    built = {}
    for name in names:
        r = REGIMES[name]
        model = build_tiny_model(
            out / f"model-{r.hidden}x{r.layers}",
            seed=0,
            hidden_size=r.hidden,
            intermediate_size=3 * r.hidden,
            num_attention_heads=r.hidden // 64,
            num_key_value_heads=max(1, r.hidden // 256),
            num_hidden_layers=r.layers,
            max_position_embeddings=512,
        )
        built[name] = (model, write_prompts(out / f"prompts-{r.shots}.jsonl", r.shots))
    return built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regimes", default="overhead,compute,prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="runs/bench-grpo")
    ap.add_argument("--json", default="benchmarks/results/speed/grpo-vs-trl.json")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--regime-json", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return

    import shutil

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    names = args.regimes.split(",")
    built = build_models(out, names)
    results: dict[str, dict[str, list[dict]]] = {}
    for name in names:
        r, (model, data) = REGIMES[name], built[name]
        results[name] = {"rlctl": [], "trl": []}
        for k in range(args.rounds):
            results[name]["rlctl"].append(rlctl_run(args, r, model, data, out / f"{name}-rlctl-{k}"))
            results[name]["trl"].append(trl_run(args, r, model, data, out / f"{name}-trl-{k}"))
            line = []
            for fw in ("rlctl", "trl"):
                x = results[name][fw][-1]
                line.append(
                    f"{fw} FAILED: {x['failed']}"
                    if "failed" in x
                    else f"{fw} {x['s_per_step']:.2f} s/step (CPU {x['cpu_s_per_step']:.2f}, load {x['load']:.1f})"
                )
            print(f"{name} round {k + 1}: " + ", ".join(line), flush=True)
    print(f"\nmedians over {args.rounds} rounds (one process, one thread each, hf rollouts):")
    summary = {}
    for name in names:
        med = {}
        for fw, runs in results[name].items():
            ok = [x for x in runs if "failed" not in x]
            med[fw] = {
                key: statistics.median(x[key] for x in ok) if ok else float("nan")
                for key in ("s_per_step", "cpu_s_per_step", "gain_per_step", "load")
            }
        target = 0.8 if name == "compute" else 0.5
        ratio_wall = med["rlctl"]["s_per_step"] / med["trl"]["s_per_step"]
        ratio_cpu = med["rlctl"]["cpu_s_per_step"] / med["trl"]["cpu_s_per_step"]
        summary[name] = {**med, "ratio_wall": ratio_wall, "ratio_cpu": ratio_cpu, "target": target}
        print(
            f"  {name:8s} rlctl {med['rlctl']['s_per_step']:.2f} s/step (CPU {med['rlctl']['cpu_s_per_step']:.2f}), "
            f"TRL {med['trl']['s_per_step']:.2f} (CPU {med['trl']['cpu_s_per_step']:.2f}): {ratio_wall:.2f}x wall, "
            f"{ratio_cpu:.2f}x CPU (target <= {target}x); reward gain/step {med['rlctl']['gain_per_step']:+.4f} "
            f"vs {med['trl']['gain_per_step']:+.4f}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    regimes = {n: asdict(REGIMES[n]) for n in names}
    Path(args.json).write_text(
        json.dumps({"args": vars(args), "regimes": regimes, "summary": summary, "runs": results}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
