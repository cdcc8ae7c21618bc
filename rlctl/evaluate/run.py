"""`rlctl eval`: sample a model on RL prompt rows and score the samples as training scores them.

The same pieces as a GRPO/PPO run: the rows are read and rendered by :func:`rlctl.data.rl.read_prompts`
(chat template, system prompt, answer field, length limit), sampled by a rollout engine
(:func:`rlctl.rollout.make_rollout_engine`, "hf" or "vllm") and scored by
:class:`rlctl.rewards.RewardManager` (the built-ins, math-verify, custom functions, a reward model). A
sample is correct when its reward is >= 1 (:data:`rlctl.evaluate.passk.CORRECT_AT`, as training's
``val/pass@k``); pass@k is the unbiased estimator of :mod:`rlctl.evaluate.passk`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlctl.config import RunConfig
from rlctl.data.io import read_rows
from rlctl.errors import UserError
from rlctl.evaluate.passk import CORRECT_AT, mean_pass_at_k


@dataclass(frozen=True)
class EvalSettings:
    """How to sample (``temperature`` 0: greedy) and where."""

    n: int = 1
    ks: tuple[int, ...] = (1,)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    engine: str = "hf"
    device: str = "cpu"
    dtype: str = "float32"
    tp: int = 1
    mem_fraction: float = 0.5
    seed: int = 0
    limit: int = 0  # evaluate only the first N usable prompts (0: all)


@dataclass
class EvalResult:
    """The summary (``metrics``) and one row per sample (``rows``)."""

    metrics: dict[str, Any]
    rows: list[dict] = field(default_factory=list)


def check_rows(path: str, split: str) -> None:
    """A UserError when the data source has no rows at all (before the model loads)."""
    rows = read_rows(path, split=split)
    if not rows.rows:
        bad = f" ({len(rows.unreadable)} unreadable line(s))" if rows.unreadable else ""
        raise UserError(f"{path}: no data rows{bad}; pass a file of prompt rows with an answer field")


def evaluate(model_dir: Path, cfg: RunConfig, s: EvalSettings, log: Callable[[str], None] = lambda m: None):
    """Sample ``s.n`` responses per prompt of ``cfg.data.path`` and score them with ``cfg.reward``."""
    from transformers import AutoTokenizer

    from rlctl.data.rl import read_prompts
    from rlctl.rewards import RewardManager, reward_metrics

    check_rows(cfg.data.path, cfg.data.split)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if cfg.data.chat_template:
        tokenizer.chat_template = Path(cfg.data.chat_template).read_text()
    prompts, report = read_prompts(cfg.data.path, tokenizer, cfg, cfg.data.split)
    if not prompts:
        raise UserError(f"{cfg.data.path}: no usable prompts: {report.summary()}")
    if s.limit:
        prompts = prompts[: s.limit]
    manager = RewardManager(cfg.reward, {p.data_source for p in prompts}, tokenizer=tokenizer)  # bad names fail here
    try:
        samples = _generate(model_dir, cfg, s, prompts, log)
        picked = [prompts[x.prompt_index] for x in samples]
        result = manager.score(manager.batch([p.token_ids for p in picked], [x.token_ids for x in samples], picked))
        reward = reward_metrics(result.sums, result.errors)
        texts = tokenizer.batch_decode([x.token_ids for x in samples], skip_special_tokens=True)
    finally:
        manager.close()
    rows = [
        {
            "prompt_index": x.prompt_index,
            "sample": i % s.n,
            "prompt": tokenizer.decode(p.token_ids),
            "response": text,
            "ground_truth": p.ground_truth,
            "data_source": p.data_source,
            "reward": score,
            "correct": score >= CORRECT_AT,
            "finish_reason": x.finish_reason,
            "response_tokens": len(x.token_ids),
        }
        for i, (x, p, text, score) in enumerate(zip(samples, picked, texts, result.scores))
    ]
    metrics = summarize(rows, len(prompts), s, reward)
    metrics["bad_rows"] = report.num_bad
    if result.errors:
        metrics["reward_errors"] = result.errors
    return EvalResult(metrics, rows)


def _generate(model_dir: Path, cfg: RunConfig, s: EvalSettings, prompts: list, log) -> list:
    from rlctl.rollout import RolloutSpec, SamplingParams, make_rollout_engine

    r = cfg.rollout
    spec = RolloutSpec(
        engine=s.engine,
        model_path=str(model_dir),
        device=s.device,
        dtype=s.dtype,
        tp=s.tp,
        mem_fraction=s.mem_fraction,
        max_model_len=r.max_prompt_len + r.max_response_len,
        seed=s.seed,
    )
    sampling = SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=r.max_response_len, seed=s.seed
    )
    log(f"sampling {len(prompts)} prompt(s) x {s.n} with {s.engine} ({'greedy' if sampling.greedy else 'sampled'})")
    images = [(p.pixel_values, p.image_grid_thw) if p.pixel_values is not None else None for p in prompts]
    from rlctl.convert.verify import hf_quiet

    with hf_quiet():  # no load report nor progress bar on the console
        engine = make_rollout_engine(spec)
    with engine:
        return engine.generate([p.token_ids for p in prompts], s.n, sampling, images=images)


def summarize(rows: list[dict], num_prompts: int, s: EvalSettings, reward: dict[str, float]) -> dict[str, Any]:
    """The summary of per-sample rows: mean reward, accuracy (share of correct samples) and pass@k."""
    correct = [0] * num_prompts
    for row in rows:
        correct[row["prompt_index"]] += bool(row["correct"])
    out: dict[str, Any] = {
        "prompts": num_prompts,
        "samples": len(rows),
        "n": s.n,
        "temperature": s.temperature,
        "engine": s.engine,
        "reward_mean": reward["reward/mean"],
        "reward_std": reward["reward/std"],
        "accuracy": sum(correct) / max(1, len(rows)),
        "reward_failed": int(reward["reward/errors"]),
    }
    for k in s.ks:
        out[f"pass@{k}"] = mean_pass_at_k(correct, s.n, k)
    return out


def pick_device(device: str | None, dtype: str | None) -> tuple[str, str]:
    """``--device`` (None: cuda when there is one, else cpu) and ``--dtype`` (None: bf16 on cuda, fp32 on cpu)."""
    from rlctl.errors import did_you_mean

    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r}{did_you_mean(device, ['cpu', 'cuda'])}: use cpu or cuda")
    dtypes = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    if dtype is None:
        dtype = "float32" if device == "cpu" else "bfloat16"
    elif dtype in dtypes:
        dtype = dtypes[dtype]
    else:
        raise UserError(f"--dtype {dtype!r}{did_you_mean(dtype, list(dtypes))}: use fp32, bf16 or fp16")
    return device, dtype
