"""sp 1 against sp 2 on the same 2 processes: the worker of tests/engines/test_ulysses.py.

Usage: torchrun --nproc-per-node 2 sp_equivalence.py MODEL_DIR OUT_PT CKPT_DIR

For sp in (1, 2), with the recipes' own functions (each rank's share as the recipes deal it):

* SFT: one step over the same documents, packed rows and right-padded rows, and packed rows with
  LoRA + activation checkpointing and with selective checkpointing + activation offload: the loss and
  the full gradients (before clipping);
* GRPO: the log-prob passes (actor and reference) and one update, with packed rows and with
  shared-prefix groups: every sample's log-probs, entropy, reference log-probs and (packed rows) a
  critic's values, by uid; the metrics and the full gradients;
* the sp 2 SFT actor (after its step) is saved, and loaded by a fresh sp 1 engine: its parameters and
  AdamW states.

Rank 0 saves {"sft": {sp: {variant: {"loss", "grads", "logits"}}}, "grpo": {sp: {prefix: {...}}}, "saved",
"loaded", "optim", "steps", "attn" (every rank's attention of a random-init sp 2 engine)}.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from rlctl.config import build_config, dotted_to_nested
from rlctl.data.packing import rank_micro_batches
from rlctl.data.sft import Example
from rlctl.engines.fsdp import FSDPEngine
from rlctl.engines.spec import LoraSpec
from rlctl.recipes.rl.advantages import compute_advantages, token_rewards
from rlctl.recipes.rl.batch import RolloutBatch, rank_positions
from rlctl.recipes.rl.passes import compute_logprobs, compute_values
from rlctl.recipes.rl.spec import AlgoSpec
from rlctl.recipes.rl.update import update_actor
from rlctl.recipes.sft import sft_loss_sum
from rlctl.runtime.dist import all_gather_objects, all_reduce_sum, init_distributed
from tests.support.sft import cpu_spec


def full_grads(engine: FSDPEngine) -> dict:
    return {name: p.grad.full_tensor().clone() for name, p in engine.model.named_parameters() if p.requires_grad}


def documents(seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    docs = []
    for n in (37, 50, 23, 61, 9):
        ids = rng.integers(3, 500, size=n)
        labels = ids.copy()
        labels[: n // 3] = -100  # the prompt's tokens: no loss
        docs.append(Example(input_ids=ids, labels=labels))
    return docs


#: the SFT variants: rows packed or right-padded, and the memory options on packed rows; the recipe's LM head
#: at the labelled positions only (each rank its shard's), but "packed_full": every position's logits
VARIANTS = {
    "packed": (True, {}),
    "packed_full": (True, {}),
    "padded": (False, {}),
    "lora_ac": (True, {"lora": LoraSpec(rank=4), "activation_checkpointing": True}),
    "savers": (True, {"selective_checkpointing": True, "offload_activations": True}),
}


def sft_step(model_dir: str, sp: int, variant: str) -> tuple[FSDPEngine, dict]:
    packing, options = VARIANTS[variant]
    keep = variant != "packed_full"
    engine = FSDPEngine(cpu_spec(model=model_dir, sp=sp, **options), role="actor", total_steps=4)
    docs = documents()
    loss_tokens = sum(int((d.labels != -100).sum()) for d in docs)
    micro = rank_micro_batches(
        docs, engine.dp_rank, engine.dp_size, packing=packing, budget=100, micro_batch_size=2, pad_id=0,
        keep_labelled=keep,
    )  # fmt: skip
    assert all((mb.keep_cols is not None) == keep for mb in micro)

    def loss_fn(logits, mb):
        loss_sum = sft_loss_sum(logits, mb)
        return loss_sum / loss_tokens, loss_sum

    sums = engine.forward_backward(micro, loss_fn)
    (total,) = all_reduce_sum([sum(float(x) for x in sums)], engine.device, engine.dp_group)
    grads = full_grads(engine)
    engine.step()
    with torch.no_grad():  # the plain forward: the logits of every position, gathered under sp
        ids = torch.as_tensor(docs[0].input_ids, dtype=torch.int64)[None]
        logits = engine.forward(ids, torch.arange(ids.shape[1])[None])
    return engine, {"loss": total / loss_tokens, "grads": grads, "logits": logits}


def rl_batch(d, sp_group, n: int) -> RolloutBatch:
    """This rank's rollout (its round-robin prompts, as a rollout engine would give them), pooled over the SP group."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 500, size=k).tolist() for k in (11, 17, 8, 14)]
    responses = [rng.integers(3, 500, size=int(rng.integers(2, 12))).tolist() for _ in range(len(prompts) * n)]
    scores = rng.normal(size=len(responses)).tolist()
    uid = [p * n + j for p in rank_positions(len(prompts), 0, d.rank, d.world_size) for j in range(n)]
    batch = RolloutBatch.build(
        [prompts[u // n] for u in uid],
        [responses[u] for u in uid],
        [[0.0] * len(responses[u]) for u in uid],
        uid,
        n=n,
        batch_size=len(prompts),
        mini_batch_size=0,
        width=12,
    )
    batch.scores = torch.tensor([scores[u] for u in uid])
    if sp_group is None:
        return batch
    return RolloutBatch.join(all_gather_objects(batch, sp_group))  # the trainer's pool()


def grpo_step(model_dir: str, sp: int, share_prefix: bool, d) -> dict:
    settings = {"model.name": model_dir, "algo.kl_coef": 0.1, "rollout.n": 4, "algo.entropy_coef": 0.01}
    cfg = build_config("grpo", [dotted_to_nested(settings)])
    actor = FSDPEngine(cpu_spec(cfg, sp=sp), role="actor", total_steps=1)
    ref = FSDPEngine(cpu_spec(cfg, sp=sp), role="ref", trainable=False)
    algo = AlgoSpec.from_config(cfg)
    batch = rl_batch(d, actor.mp_group, cfg.rollout.n)
    kw = {"temperature": 0.9, "budget": 60, "pad_id": 0, "share_prefix": share_prefix}
    batch.old_logp, entropy = compute_logprobs(actor, batch, with_entropy=True, **kw)
    batch.ref_logp, _ = compute_logprobs(ref, batch, **kw)
    batch.advantages, batch.returns = compute_advantages(batch, algo, token_rewards(batch), actor.dp_group)
    grads: dict = {}
    step = actor.step

    def keeping_gradients() -> float:
        grads.update(full_grads(actor))
        return step()

    actor.step = keeping_gradients
    metrics = update_actor(actor, batch, algo, budget=60, pad_id=0, kl_loss_coef=0.1, share_prefix=share_prefix)
    values = batch.mask
    if not share_prefix:  # a PPO critic's values (packed rows)
        critic = FSDPEngine(cpu_spec(cfg, sp=sp), role="critic", total_steps=1)
        values = compute_values(critic, batch, budget=60, pad_id=0)
    logp = {int(u): (batch.old_logp[i], entropy[i], batch.ref_logp[i], values[i]) for i, u in enumerate(batch.uid)}
    merged: dict = {}
    for part in all_gather_objects(logp):
        merged.update(part)
    return {"logp": merged, "metrics": metrics, "grads": grads}


def main(model_dir: str, out: str, ckpt: str) -> None:
    d = init_distributed("cpu")
    results: dict = {"sft": {}, "grpo": {}}
    for sp in (1, 2):
        results["sft"][sp] = {}
        for variant in VARIANTS:
            engine, r = sft_step(model_dir, sp, variant)
            results["sft"][sp][variant] = r
            if variant == "padded":
                saved = engine
        results["grpo"][sp] = {prefix: grpo_step(model_dir, sp, prefix, d) for prefix in (False, True)}
    engine = saved  # the sp 2 engine after its SFT step on padded rows
    engine.save_checkpoint(ckpt)
    results["saved"] = {name: t.clone() for name, t in engine.iter_full_params()}
    fresh = FSDPEngine(cpu_spec(model=model_dir, sp=1, seed=7), role="actor", total_steps=4)
    fresh.load_checkpoint(ckpt)
    results["loaded"] = {name: t.clone() for name, t in fresh.iter_full_params()}
    results["steps"] = (engine.global_step, fresh.global_step)
    results["optim"] = optimizer_difference(engine, fresh)
    random = FSDPEngine(cpu_spec(model=model_dir, sp=2, random_init=True), role="actor")
    results["attn"] = all_gather_objects(random.parts.hf.config._attn_implementation)  # every rank's
    if d.rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


def optimizer_difference(a: FSDPEngine, b: FSDPEngine) -> float:
    """The largest difference between two engines' AdamW states (collective: full tensors)."""
    worst = 0.0
    for pa, pb in zip(
        a.optimizer.param_groups[0]["params"] + a.optimizer.param_groups[1]["params"],
        b.optimizer.param_groups[0]["params"] + b.optimizer.param_groups[1]["params"],
    ):
        for key in ("exp_avg", "exp_avg_sq"):
            x, y = a.optimizer.state[pa][key].full_tensor(), b.optimizer.state[pb][key].full_tensor()
            worst = max(worst, float((x - y).abs().max()))
    return worst


if __name__ == "__main__":
    main(*sys.argv[1:4])
