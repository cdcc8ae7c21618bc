"""GPU faults found by reading vLLM 0.32, SGLang 0.5.23, torch's c10d and rlctl's offload code (issue 35).

No GPU here. Each test runs rlctl's own code with the boundary that cannot run on this machine faked and
labelled FAKE, and, where the library is installed, calls the library's own function (vLLM's
``request_memory``). Each failed before its fix.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

GIB = 2**30


# ---------------------------------------------------------------------------------------------
# 1. A split run's evaluation engine on the trainer GPUs


def _split_run_config():
    """Qwen2.5-7B GRPO on 8 H100s, 2 of them rollout-only, vLLM, evaluated before training."""
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.plan import apply_plan
    from rlctl.plan.inputs import LocalEnv
    from rlctl.plan.planner import plan_config
    from rlctl.presets import method_layers

    sets = {
        "model.name": "Qwen2.5-7B",
        "hardware.device": "cuda",
        "hardware.gpus": 8,
        "hardware.gpu": "H100",
        "rollout.engine": "vllm",
        "rollout.procs": 2,
        "train.eval_before": True,
    }
    cfg = build_config("grpo", method_layers("grpo", None) + [dotted_to_nested(sets)])
    plan = plan_config(cfg, LocalEnv(installed=frozenset({"vllm"})))
    return apply_plan(cfg, plan), plan


def test_split_run_evaluation_engine_fits_beside_the_trainer(monkeypatch):
    """Evaluation in a one-step-off-policy run builds a rollout engine on every TRAINER GPU. It took the
    rollout GPUs' fraction (0.85: nothing else lives there), but a trainer GPU holds the trainer's weights,
    optimizer states and reference model: vLLM's own ``request_memory`` refuses to start when less than
    ``fraction x total`` is free. The plan now records a fraction for that engine, derived from the same
    estimate, and the trainer's evaluation engine gets it (the rollout processes keep theirs).
    (FAKE: the engine constructor is recorded; vLLM's memory snapshot is a record of total and free bytes.)"""
    from vllm.config import CacheConfig
    from vllm.v1.worker.utils import request_memory

    from rlctl.recipes.rl.sampling import Sampling
    from rlctl.rollout import RolloutSpec

    cfg, plan = _split_run_config()
    assert cfg.rollout.mem_fraction == plan.rollout_mem_fraction >= 0.8  # the rollout GPUs hold the engine alone
    assert 0 < cfg.rollout.eval_mem_fraction == plan.rollout_eval_mem_fraction < cfg.rollout.mem_fraction
    assert any(d.key == "rollout.eval_mem_fraction" for d in plan.decisions)

    built = []
    monkeypatch.setattr("rlctl.rollout.make_rollout_engine", built.append)
    d = SimpleNamespace(rank=0, world_size=6, local_rank=0, local_world_size=6)
    trainer = SimpleNamespace(
        cfg=cfg,
        dist=d,
        feed=object(),  # a split run's trainer: its samples come from the rollout processes
        rollout_tp=1,
        rollout_path="/model",
        device=torch.device("cuda", 0),
        rollout_dtype="bf16",
        ctx=SimpleNamespace(log=lambda line: None),
    )
    Sampling._make_rollout(trainer)
    (spec,) = built
    # what the trainer holds on its GPU while it evaluates, from the estimate's training phase
    parts = plan.estimate.phases["training"].components
    held = sum(parts[k] for k in ("weights", "optimizer_states", "reference_model", "cuda_context"))
    total = plan.estimate.gpu_memory_bytes
    assert held > 0.15 * total
    snapshot = SimpleNamespace(total_memory=total, free_memory=total - held, device_="cuda:0")
    request_memory(snapshot, CacheConfig(gpu_memory_utilization=spec.mem_fraction))  # vLLM starts
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        # the rollout GPUs' fraction (what the trainer's engine got before) on the same GPU
        request_memory(snapshot, CacheConfig(gpu_memory_utilization=RolloutSpec.from_config(cfg).mem_fraction))
