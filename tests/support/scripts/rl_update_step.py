"""One GRPO update on a fixed rollout batch, under torchrun: the world-size equality test's worker.

Usage: torchrun --nproc-per-node W update_step.py MODEL_DIR BATCH_JSON OUT_PT

BATCH_JSON: {"n", "prompts": [[ids] per prompt], "responses": [[ids] per sample, prompt-major],
"scores": [per sample], "settings": {dotted config keys}, "aggs": [loss aggregation modes]}.
For each mode a fresh actor takes one optimizer step on the whole batch with the recipe's own
functions (rank shares, packed micro-batches, global advantages and denominators); rank 0 saves
{mode: {"params": {name: tensor}, "grads": {name: tensor} (before clipping), "grad_norm": float}}
to OUT_PT.
"""

from __future__ import annotations

import json
import sys

import torch

from rlctl.config import build_config, dotted_to_nested
from rlctl.engines.fsdp import FSDPEngine
from rlctl.recipes.rl.advantages import compute_advantages, token_rewards
from rlctl.recipes.rl.batch import RolloutBatch, rank_positions, token_budget
from rlctl.recipes.rl.passes import compute_logprobs
from rlctl.recipes.rl.spec import AlgoSpec
from rlctl.recipes.rl.update import update_actor
from rlctl.runtime.dist import init_distributed
from tests.support.sft import cpu_spec


def one_update(model_dir: str, spec: dict, agg: str, d) -> tuple[FSDPEngine, dict]:
    settings = {**spec["settings"], "model.name": model_dir, "algo.loss_agg": agg}
    cfg = build_config("grpo", [dotted_to_nested(settings)])
    actor = FSDPEngine(cpu_spec(cfg), role="actor", total_steps=1)
    ref = FSDPEngine(cpu_spec(cfg), role="ref", trainable=False)
    n, prompts = spec["n"], spec["prompts"]
    mini = cfg.algo.mini_batch_size
    positions = rank_positions(len(prompts), mini, d.rank, d.world_size)
    uid = [p * n + j for p in positions for j in range(n)]
    batch = RolloutBatch.build(
        [prompts[u // n] for u in uid],
        [spec["responses"][u] for u in uid],
        [[0.0] * len(spec["responses"][u]) for u in uid],
        uid,
        n=n,
        batch_size=len(prompts),
        mini_batch_size=mini,
        width=cfg.rollout.max_response_len,
    )
    batch.scores = torch.tensor([spec["scores"][u] for u in uid])
    budget, t = token_budget(cfg), cfg.rollout.temperature
    batch.old_logp, _ = compute_logprobs(actor, batch, temperature=t, budget=budget, pad_id=0)
    batch.ref_logp, _ = compute_logprobs(ref, batch, temperature=t, budget=budget, pad_id=0)
    batch.advantages, batch.returns = compute_advantages(batch, AlgoSpec.from_config(cfg), token_rewards(batch))
    grads = keep_gradients(actor)
    metrics = update_actor(
        actor, batch, AlgoSpec.from_config(cfg), budget=budget, pad_id=0, kl_loss_coef=cfg.algo.kl_coef
    )
    return actor, {**metrics, "grads": grads}


def keep_gradients(actor: FSDPEngine) -> dict:
    """Make ``actor.step`` first copy the full gradients (before clipping) into the returned dict."""
    grads: dict = {}
    step = actor.step

    def step_keeping_gradients() -> float:
        for name, p in actor.model.named_parameters():
            grads[name] = p.grad.full_tensor().clone()  # collective: every rank, same order
        return step()

    actor.step = step_keeping_gradients
    return grads


def main(model_dir: str, batch_json: str, out: str) -> None:
    d = init_distributed("cpu")
    with open(batch_json) as f:
        spec = json.load(f)
    results = {}
    for agg in spec["aggs"]:
        actor, metrics = one_update(model_dir, spec, agg, d)
        params = {name: t.clone() for name, t in actor.iter_full_params()}  # collective: every rank iterates
        results[agg] = {"params": params, "grads": metrics["grads"], "grad_norm": metrics["grad_norm"]}
    if d.rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
