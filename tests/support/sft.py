"""Helpers for the SFT and engine tests: tiny chat data, a CPU plan, and launching runs."""

from __future__ import annotations

import json
import random
from pathlib import Path


def chat_rows(n: int, *, seed: int = 0, multi_turn_every: int = 4) -> list[dict]:
    """Arithmetic conversations the tiny tokenizer knows; every k-th one has two assistant turns."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(0, 100, 3), rng.randrange(0, 100, 7)
        messages = [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"The answer is {a + b}. #### {a + b}"},
        ]
        if multi_turn_every and i % multi_turn_every == 0:
            messages += [
                {"role": "user", "content": f"Compute {a} * {b}"},
                {"role": "assistant", "content": f"{a} * {b} = {a * b}"},
            ]
        rows.append({"messages": messages})
    return rows


def pair_rows(n: int, *, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(0, 100, 3), rng.randrange(0, 100, 7)
        out.append({"prompt": f"Compute {a} - {b}", "response": f"{a} - {b} = {a - b}"})
    return out


def write_jsonl(path: str | Path, rows: list) -> Path:
    path = Path(path)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


class CpuPlan(dict):
    """A dict of plan fields that reads like the typed rlctl.plan.Plan too (``plan.device``, ``to_dict()``)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict:
        return dict(self)


def cpu_plan(nproc: int, **overrides) -> CpuPlan:
    """The fields of rlctl.plan.Plan that the launcher and the engine read, for a CPU run."""
    plan = {
        "method": "sft",
        "device": "cpu",
        "gpu": "",
        "gpus": 0,
        "nodes": 1,
        "nproc_per_node": nproc,
        "backend": "fsdp",
        "tp": 1,
        "pp": 1,
        "dp": nproc,
        "cp": 1,
        "ep": 1,
        "sp": 1,
        "sequence_parallel": False,
        "rollout": None,
        "rollout_mem_fraction": 0.5,
        "rollout_eval_mem_fraction": 0.0,
        "micro_batch_size": 2,
        "activation_checkpointing": False,
        "selective_checkpointing": False,
        "offload_activations": False,
        "shard": True,
        "offload_params": False,
        "offload_optimizer": False,
        "dtype": "fp32",
        "attn": "sdpa",
        "lora_rank": 0,
        "decisions": [],
        "warnings": [],
        "verdict": {"fits": True, "why": "a CPU test run"},
        "advice": [],
        "fits": True,
    }
    plan.update(overrides)
    return CpuPlan(plan)


def cpu_spec(cfg=None, **overrides):
    """The EngineSpec of a one-process CPU run in fp32 (what ``EngineSpec.from_config`` gives for the
    config the planner resolves from :func:`cpu_plan`), with the model, seed, optimizer and LoRA of
    ``cfg`` (an unresolved config is fine: those fields are never planned)."""
    from rlctl.engines.spec import EngineSpec

    run = EngineSpec.run_fields(cfg) if cfg is not None else {}
    return EngineSpec(**{"backend": "fsdp", "device": "cpu", "dtype": "fp32", "attn": "sdpa", **run, **overrides})


def sft_config(model_dir: Path, data: Path, out: Path, **sets):
    """A RunConfig for a fast CPU SFT run; ``sets`` are dotted keys with '__' for '.' (train__lr=1e-3)."""
    from rlctl.config import build_config, dotted_to_nested

    base = {
        "model.name": str(model_dir),
        "data.path": str(data),
        "output_dir": str(out),
        "hardware.device": "cpu",
        "train.max_len": 96,
        "train.batch_size": 8,
        "train.lr": 3e-3,
        "train.warmup_ratio": 0.0,
        "train.min_lr_ratio": 0.1,
        "train.max_steps": 6,
        "model.attn": "sdpa",
        "model.dtype": "fp32",
    }
    base.update({k.replace("__", "."): v for k, v in sets.items()})
    return build_config("sft", [dotted_to_nested(base)])


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (the last record of a step wins, as after a resume)."""
    from rlctl.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "loss" in r}
