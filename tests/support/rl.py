"""Helpers for the GRPO / PPO tests: prompt data, reward files, configs, metrics."""

from __future__ import annotations

import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
REWARDS = HERE / "rl_rewards.py"  # digits (the easy reward), always_fails
UPDATE_STEP = HERE / "scripts" / "rl_update_step.py"  # one update on a fixed batch, under torchrun


def arith_rows(n: int, *, seed: int = 0, answer_field: str = "answer") -> list[dict]:
    """Plain RL rows {"prompt", "answer"} the tiny tokenizer knows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(0, 100, 3), rng.randrange(0, 100, 7)
        rows.append({"prompt": f"What is {a} + {b}?", answer_field: str(a + b)})
    return rows


def verl_rows(n: int, *, seed: int = 0) -> list[dict]:
    """Rows in verl's RL parquet schema."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r["answer"]},
            "extra_info": {"split": "train", "index": i},
        }
        for i, r in enumerate(arith_rows(n, seed=seed))
    ]


def sampled_batch(
    prompts: list[list[int]], n: int, *, width: int, vocab: int, rng: random.Random, seed: int, meta=None
):
    """A step's RolloutBatch: ``n`` random responses (1 to ``width`` token ids in [4, ``vocab``), drawn from
    ``rng``) to each of ``prompts``, with random advantages (seeded by ``seed``); ``meta``: each prompt's
    rlctl.data.rl Prompt (images), or None."""
    import torch

    from rlctl.recipes.rl.batch import RolloutBatch

    uid = list(range(len(prompts) * n))
    responses = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, width))] for _ in uid]
    batch = RolloutBatch.build(
        [prompts[u // n] for u in uid],
        responses,
        [[-1.0] * len(r) for r in responses],
        uid,
        n=n,
        batch_size=len(prompts),
        mini_batch_size=0,
        width=width,
        meta=None if meta is None else [meta[u // n] for u in uid],
    )
    batch.advantages = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(seed)) * batch.mask
    return batch


def rl_args(model_dir: Path, data: Path, out: Path, *extra: str) -> list[str]:
    """CLI arguments of a fast 2-process CPU run (tiny model, short responses, high lr)."""
    return [
        "--model",
        str(model_dir),
        "--data",
        str(data),
        "--output-dir",
        str(out),
        "--device",
        "cpu",
        "--nproc",
        "2",
        "--batch-size",
        "4",
        "--n",
        "8",
        "--max-prompt-len",
        "48",
        "--max-response-len",
        "12",
        "--lr",
        "1e-2",
        "--reward",
        f"{REWARDS}:digits",
        *extra,
    ]


def train_records(run_dir: Path) -> list[dict]:
    """The training records of metrics.jsonl (the last record of a step wins, as after a resume)."""
    from rlctl.metrics import read_metrics

    by_step = {r["step"]: r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if r.get("kind") != "eval"}
    return [by_step[s] for s in sorted(by_step)]


def error_line(result) -> str:
    """The user-facing error of a failed CLI run: its last non-empty stderr line."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def failure(result, run_dir: Path) -> str:
    """What to show when a CLI run failed: its output and the end of its train.log."""
    log = Path(run_dir) / "train.log"
    tail = log.read_text()[-4000:] if log.is_file() else "(no train.log)"
    return f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}\n{tail}"


def eos_prone_model(model_dir: Path, out: Path, strength: float = 0.5) -> Path:
    """A copy of the tiny random model whose eos logit follows the mean direction of its last hidden
    states (``strength`` times its unit vector as eos's row of lm_head): about half of its 12-token
    responses end with eos, the others are truncated (DAPO's overlong filtering has both to tell apart)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(model_dir, out)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    chats = [[{"role": "user", "content": r["prompt"]}] for r in arith_rows(8)]
    inputs = tok.apply_chat_template(
        chats, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
    )
    with torch.no_grad():
        hidden = model(**inputs, output_hidden_states=True).hidden_states[-1]
    mean = hidden[inputs["attention_mask"].bool()].mean(0)
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"][tok.eos_token_id] = strength * mean / mean.norm()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
