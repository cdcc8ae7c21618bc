"""What the GRPO benchmarks against TRL share (grpo_vs_trl.py, agent_grpo_vs_trl.py): an `rlctl grpo` run
clocked, a TRL worker run in a process of its own, TRL's GRPOConfig with the settings both frameworks are
given alike, TRL's step clock, and the medians over rounds.

Measured from the end of step WARMUP_STEPS to the end of the last step: seconds per step by the wall
clock and by the training process's CPU time, sampled for rlctl when its metrics.jsonl grows and for
TRL in a callback. Reward gain per step: the least-squares slope of the mean training reward.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sft_vs_trl import WARMUP_STEPS, _env, run_rlctl_clocked

LR = 1e-4


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


def rlctl_grpo_argv(model: Path, data: Path, reward: str, out: Path, steps: int, *, batch: int, n: int,
                    temperature: float, max_prompt_len: int, response_len: int) -> list[str]:  # fmt: skip
    """``rlctl grpo`` on one CPU process with hf rollouts, constant settings shared with TRL, no HF export."""
    argv = [sys.executable, "-m", "rlctl", "grpo", "--model", str(model), "--data", str(data)]
    argv += ["--reward", reward, "--device", "cpu", "--nproc", "1", "--rollout", "hf", "-o", str(out)]
    argv += ["--max-steps", str(steps), "--batch-size", str(batch), "--n", str(n), "--lr", str(LR)]
    argv += ["--temperature", str(temperature), "--max-prompt-len", str(max_prompt_len)]
    argv += ["--max-response-len", str(response_len), "--kl-coef", "0", "--seed", "0"]
    return argv + ["--set", "checkpoint.export_hf=false"]


def rlctl_run(argv: list[str], out: Path) -> tuple[dict, list[dict]]:
    """Run ``argv`` (an ``rlctl grpo`` command writing to ``out``), clocked: its step times, rewards, reward
    gain, load average and mean phase times; and its training records (metrics.jsonl, no eval rows)."""
    load = os.getloadavg()[0]
    marks = run_rlctl_clocked(argv, out, "grpo", out.parent / f"{out.name}.log")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [x for x in records if x.get("kind") != "eval"]
    rewards = [x["reward"] for x in records]
    times = {k: statistics.mean(x.get(k, 0.0) for x in records[WARMUP_STEPS:]) for k in records[-1] if "time/" in k}
    result = {**step_times(marks), "rewards": rewards, "gain_per_step": slope(rewards), "load": load, "phases": times}
    return result, records


def add_worker_flags(ap: argparse.ArgumentParser, setting_flag: str) -> None:
    """The hidden flags :func:`trl_run` gives ``script --trl-worker``: the worker's setting as JSON
    (``setting_flag``, what ``extra`` passes), its model and its data (``--out`` and ``--steps`` are public)."""
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(setting_flag, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)


def trl_run(script: str, extra: list[str], model: Path, data: Path, out: Path, steps: int) -> dict:
    """Run ``script --trl-worker`` (its TRL run) in a process of its own; its OUT/result.json, the reward
    gain and the load average, or ``{"failed": the last error line}``."""
    argv = [sys.executable, script, "--trl-worker", "--model", str(model), "--data", str(data), "--out", str(out)]
    argv += ["--steps", str(steps), *extra]
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


def trl_clock(marks: dict[int, tuple[float, float]], rewards: list[float], on_logs=None):
    """A TrainerCallback noting (CPU time, wall time) at the end of each step into ``marks`` (step 0: now)
    and each logged mean reward into ``rewards``; ``on_logs(logs)`` sees each log that has a reward."""
    from transformers import TrainerCallback

    marks[0] = (time.process_time(), time.perf_counter())

    class Clock(TrainerCallback):
        def on_step_end(self, cfg, state, *a, **k):
            marks[state.global_step] = (time.process_time(), time.perf_counter())

        def on_log(self, cfg, state, control, logs=None, **k):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                if on_logs is not None:
                    on_logs(logs)

    return Clock()


def trl_grpo_config(out: Path, steps: int, *, batch: int, n: int, response_len: int, temperature: float, **extra):
    """TRL's GRPOConfig with rlctl's settings: constant lr, clip 0.2, token-mean loss (``dapo``), group-normalised
    advantages, no KL and no reference model, one optimizer step per batch, CPU, fp32, no checkpoints."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=batch * n,
        num_generations=n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=response_len,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        temperature=temperature,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        seed=0,
        disable_tqdm=True,
        **extra,
    )


def trl_model_and_tokenizer(model: str):
    """The model (fp32, sdpa) and tokenizer TRL trains, on one thread."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model)
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa"), tok


def run_line(fw: str, x: dict, detail: str = "") -> str:
    """One run in a line: ``rlctl 1.23 s/step (CPU 1.20, load 0.5)`` (``detail`` before the load), or its failure."""
    if "failed" in x:
        return f"{fw} FAILED: {x['failed']}"
    return f"{fw} {x['s_per_step']:.2f} s/step (CPU {x['cpu_s_per_step']:.2f}, {detail}load {x['load']:.1f})"


def medians(results: dict[str, list[dict]], keys: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per framework, the median of each of ``keys`` over its runs that did not fail (nan if all did)."""
    med = {}
    for fw, runs in results.items():
        ok = [x for x in runs if "failed" not in x]
        med[fw] = {key: statistics.median(x[key] for x in ok) if ok else float("nan") for key in keys}
    return med


def ratios(med: dict[str, dict[str, float]]) -> dict[str, float]:
    """rlctl's seconds per step over TRL's, by the wall clock and by CPU time."""
    return {
        "ratio_wall": med["rlctl"]["s_per_step"] / med["trl"]["s_per_step"],
        "ratio_cpu": med["rlctl"]["cpu_s_per_step"] / med["trl"]["cpu_s_per_step"],
    }
