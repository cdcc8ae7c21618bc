"""`rlctl eval`: sample a model on RL prompt rows and score the samples as training scores them.

The same pieces as a GRPO/PPO run: the rows are read and rendered by :func:`rlctl.data.rl.read_prompts`
(chat template, system prompt, answer field, length limit), sampled by a rollout engine
(:func:`rlctl.rollout.make_rollout_engine`, "hf" or "vllm") and scored by
:class:`rlctl.rewards.RewardManager` (the built-ins, math-verify, custom functions, a reward model). A
sample is correct when its reward is >= 1 (:data:`rlctl.evaluate.passk.CORRECT_AT`, as training's
``val/pass@k``); pass@k is the unbiased estimator of :mod:`rlctl.evaluate.passk`.
"""

from __future__ import annotations

import time
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


def evaluate(model_dir: Path, cfg: RunConfig, s: EvalSettings, agent=None, log: Callable[[str], None] = lambda m: None):
    """Sample ``s.n`` responses per prompt of ``cfg.data.path`` and score them with ``cfg.reward``; with
    ``agent`` (the spec of ``agent.tools`` / ``agent.env``: rlctl.evaluate.settings.load_tools) each sample is
    a multi-turn trajectory of training's agent loop."""
    from transformers import AutoTokenizer

    from rlctl.config import agent_enabled
    from rlctl.data.rl import read_prompts
    from rlctl.rewards import RewardManager, reward_metrics

    check_rows(cfg.data.path, cfg.data.split)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if cfg.data.chat_template:
        tokenizer.chat_template = Path(cfg.data.chat_template).read_text()
    tools = agent.schemas if agent is not None else None
    prompts, report = read_prompts(cfg.data.path, tokenizer, cfg, cfg.data.split, tools=tools)
    if not prompts:
        raise UserError(f"{cfg.data.path}: no usable prompts: {report.summary()}")
    prompts = prompts[: s.limit] if s.limit else prompts
    sources = {p.data_source for p in prompts}
    manager = RewardManager(cfg.reward, sources, tokenizer=tokenizer, agent=agent_enabled(cfg))  # bad names fail now
    try:
        start = time.perf_counter()
        samples = _generate(model_dir, cfg, s, prompts, tokenizer, agent, log)
        generate_s = time.perf_counter() - start
        picked = [prompts[x.prompt_index] for x in samples]
        prompt_ids = [x.prompt_ids if agent else p.token_ids for x, p in zip(samples, picked)]
        trajectories = samples if agent else None
        result = manager.score(manager.batch(prompt_ids, [x.token_ids for x in samples], picked, trajectories))
        reward = reward_metrics(result.sums, result.errors)
    finally:
        manager.close()
    rows = sample_rows(samples, picked, prompt_ids, result.scores, tokenizer, s.n)
    metrics = summarize(rows, len(prompts), s, reward)
    metrics["bad_rows"] = report.num_bad
    metrics.update(throughput(rows, generate_s, s.device))
    if result.errors:
        metrics["reward_errors"] = result.errors
    return EvalResult(metrics, rows)


def throughput(rows: list[dict], generate_s: float, device: str) -> dict[str, Any]:
    """The sampling's wall time (the engine's start-up included), its response tokens per second, and on CUDA
    torch's allocator peaks of this process (the engine lives in it: hf; vLLM's own allocator is not torch's)."""
    tokens = sum(r["response_tokens"] for r in rows)
    out: dict[str, Any] = {"generate_s": generate_s, "response_tokens": tokens, "tokens_per_s": tokens / generate_s}
    if device.startswith("cuda"):
        import torch

        out["torch_allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
        out["torch_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
    return out


def sample_rows(samples: list, picked: list, prompt_ids: list, scores: list[float], tokenizer, n: int) -> list[dict]:
    """One row per sample (a Sample, or an agent run's Trajectory: its turns and tool calls too)."""
    texts = tokenizer.batch_decode([x.token_ids for x in samples], skip_special_tokens=True)
    rows = []
    for i, (x, p, ids, text, score) in enumerate(zip(samples, picked, prompt_ids, texts, scores)):
        row = {
            "prompt_index": x.prompt_index,
            "sample": i % n,
            "prompt": tokenizer.decode(ids),
            "response": text,
            "ground_truth": p.ground_truth,
            "data_source": p.data_source,
            "reward": score,
            "correct": score >= CORRECT_AT,
            "finish_reason": x.finish_reason,
            "response_tokens": len(x.token_ids),
        }
        if hasattr(x, "turns"):
            row.update(turns=x.turns, tool_calls=x.tool_calls, tool_errors=x.tool_errors)
        rows.append(row)
    return rows


def _generate(model_dir: Path, cfg: RunConfig, s: EvalSettings, prompts: list, tokenizer, agent, log) -> list:
    """The samples (prompt-major): the engine's, or the agent loop's trajectories when ``agent``."""
    from rlctl.recipes.rl.turns import make_agent_loop, run_agent
    from rlctl.rollout import RolloutSpec, SamplingParams

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
    how = "greedy" if sampling.greedy else "sampled"
    log(f"sampling {len(prompts)} prompt(s) x {s.n} with {s.engine} ({how}{', multi-turn' if agent else ''})")
    with make_engine(spec) as engine:
        if agent is not None:
            return run_agent(make_agent_loop(cfg, agent, tokenizer, engine, s.tp), cfg, engine, prompts, s.n, sampling)
        images = [(p.pixel_values, p.image_grid_thw) if p.pixel_values is not None else None for p in prompts]
        return engine.generate([p.token_ids for p in prompts], s.n, sampling, images=images)


def make_engine(spec):
    """The rollout engine of ``spec``, quietly: no transformers load report or progress bar, vLLM's log on
    stderr (stdout is the reply or the JSON), and ``max_model_len`` capped at the model's
    ``max_position_embeddings`` (vLLM refuses a longer one)."""
    import json
    import os

    from rlctl.convert.verify import hf_quiet
    from rlctl.rollout import make_rollout_engine

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    config = json.loads((Path(spec.model_path) / "config.json").read_text())
    longest = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
    if longest and spec.max_model_len > longest:
        spec = spec.replace(max_model_len=int(longest))
    with hf_quiet():
        return make_rollout_engine(spec)


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
