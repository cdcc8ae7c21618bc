"""The speed paths compute the same numbers as the plain ones (fp32, 1e-5): shared-prefix micro-batches,
packed rows and one sample per micro-batch give a plain HF model's per-sample log-probs and gradients,
and skipping the old log-prob pass (one optimizer step per batch) gives the same update."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.support.rl import sampled_batch
from tests.support.sft import cpu_spec

TOL = 1e-5
TEMPERATURE = 0.7


def rl_config(model_dir, **sets):
    from rlctl.config import build_config, dotted_to_nested

    base = {
        "model.name": str(model_dir),
        "rollout.max_prompt_len": 48,
        "rollout.max_response_len": 12,
        "rollout.temperature": TEMPERATURE,
        "model.attn": "sdpa",
        "model.dtype": "fp32",
        "train.grad_clip": 0.0,
    }
    base.update(sets)
    return build_config("grpo", [dotted_to_nested(base)])


def group_batch(n_prompts: int, n: int, *, width: int, seed: int):
    """Random prompts of different lengths, ``n`` random responses of different lengths each."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, 400) for _ in range(rng.randint(2, 20))] for _ in range(n_prompts)]
    return sampled_batch(prompts, n, width=width, vocab=400, rng=rng, seed=seed)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out[name] = g.detach().clone()
    return out


def plain_reference(model_dir, batch, weights):
    """Each sample alone through a plain HF model: log-probs [b, W] and the gradient of sum(weights * logp)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    logp = torch.zeros_like(batch.mask)
    for i in range(len(batch)):
        p, r = batch.prompts[i], batch.responses[i]
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1] / TEMPERATURE
        lp = logits.log_softmax(-1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        (lp * weights[i, : len(r)]).sum().backward()
        logp[i, : len(r)] = lp.detach()
    return logp, full_grads(model)


def engine_pass(engine, batch, weights, *, budget: int, share_prefix: bool, split: bool = True, per_block=False):
    """Log-probs and the gradient of sum(weights * logp) through the engine's micro-batches. ``per_block``:
    one sdpa call per block however short the rows (else rows up to varlen.DENSE_MAX_LEN run one masked call)."""
    from rlctl.algos import logprobs_from_logits
    from rlctl.engines import varlen
    from rlctl.recipes.rl.batch import micro_batches

    micro = micro_batches(
        batch, list(range(len(batch))), budget=budget, pad_id=0, device=torch.device("cpu"), share_prefix=share_prefix
    )
    assert all((mb.keep_cols is not None) == share_prefix for mb in micro)
    # unsplit (engine.varlen False): the engine gives shared rows the dense 4-D mask of their blocks, and
    # packed rows transformers' own mask from the positions
    engine.varlen = split
    saved, varlen.DENSE_MAX_LEN = varlen.DENSE_MAX_LEN, 0 if per_block else varlen.DENSE_MAX_LEN

    def loss_fn(logits, mb):
        lp = mb.to_matrix(logprobs_from_logits(mb.at_response(logits), mb.labels, TEMPERATURE))
        return (lp * mb.take(weights)).sum(), lp

    engine.train(False)  # no dropout: the same function as the plain model's
    try:
        outs = engine.forward_backward(micro, loss_fn)
    finally:
        varlen.DENSE_MAX_LEN = saved
    logp = torch.zeros_like(batch.mask)
    for mb, lp in zip(micro, outs):
        logp[mb.rows, : mb.width] = lp
    grads = full_grads(engine.model)
    engine.optimizer.zero_grad(set_to_none=True)
    return logp, grads, micro


def test_shared_prefix_packed_and_unpacked_match_a_plain_model(tiny_model_dir, process_group):
    """Shared prefix on/off and packing on/off: each sample's log-probs and the gradients of a weighted sum
    of them equal a plain HF model run on one sample at a time (eager attention, no packing)."""
    from rlctl.engines import varlen
    from rlctl.engines.fsdp import FSDPEngine

    batch = group_batch(3, 4, width=9, seed=1)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2)) * batch.mask
    want_logp, want_grads = plain_reference(tiny_model_dir, batch, weights)
    engine = FSDPEngine(cpu_spec(rl_config(tiny_model_dir)), total_steps=1)
    assert engine.shares_prefix
    longest = max(batch.lengths)
    settings = {
        "shared prefix, one micro-batch": dict(budget=10_000, share_prefix=True),
        "shared prefix, one sdpa call per block": dict(budget=10_000, share_prefix=True, per_block=True),
        "shared prefix, a micro-batch per group or less": dict(budget=longest, share_prefix=True),
        "shared prefix, 4-D mask": dict(budget=10_000, share_prefix=True, split=False),
        "packed rows": dict(budget=2 * longest, share_prefix=False),
        "packed rows, one block-diagonal mask": dict(budget=2 * longest, share_prefix=False, split=False),
        "one sample per micro-batch": dict(budget=longest, share_prefix=False),
    }
    for name, kw in settings.items():
        logp, grads, micro = engine_pass(engine, batch, weights, **kw)
        assert torch.allclose(logp, want_logp, atol=TOL, rtol=0), name
        assert grads.keys() == want_grads.keys(), name
        for key, g in want_grads.items():
            assert torch.allclose(grads[key], g, atol=TOL, rtol=1e-4), f"{name}: {key}"
    # the shared-prefix layout really holds each prompt once: P + sum(R - 1) tokens per group
    _, _, micro = engine_pass(engine, batch, weights, budget=10_000, share_prefix=True)
    (mb,) = micro
    prompts = {tuple(p) for p in batch.prompts}
    mask = varlen.dense_mask(mb.blocks, *mb.input_ids.shape, mb.input_ids.device)
    assert int(mask.diagonal(dim1=-2, dim2=-1).sum()) == mb.input_ids.numel()
    real = sum(len(p) for p in prompts) + sum(len(r) - 1 for r in batch.responses)
    assert mb.input_ids.shape[0] == len(prompts) and int((mb.position_ids > 0).sum()) + len(prompts) >= real


def run_update(model_dir, batch, *, skip_old_pass: bool, **sets):
    """One update_actor call on a fresh engine; returns its metrics and the gradients of its one step."""
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.recipes.rl.passes import compute_logprobs
    from rlctl.recipes.rl.spec import AlgoSpec
    from rlctl.recipes.rl.update import update_actor

    cfg = rl_config(model_dir, **sets)
    engine = FSDPEngine(cpu_spec(cfg), total_steps=1)
    engine.train(False)  # no dropout in either run
    engine.train = lambda mode=True: None  # keep it off through the passes
    batch.old_logp = None
    if not skip_old_pass:
        batch.old_logp, _ = compute_logprobs(engine, batch, temperature=TEMPERATURE, budget=10_000, pad_id=0)
    seen = {}
    step = engine.step

    def recording_step():
        seen.update(full_grads(engine.model))
        return step()

    engine.step = recording_step
    metrics = update_actor(engine, batch, AlgoSpec.from_config(cfg), budget=10_000, pad_id=0)
    return metrics, seen


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo"])
def test_skipping_the_old_logprob_pass_gives_the_same_update(tiny_model_dir, process_group, policy_loss):
    """One optimizer step per batch: old log-probs taken from the update's own forward (detached) give the
    loss, the gradients and the logged rollout/logprob_diff of a separate log-prob pass."""
    batch = group_batch(2, 3, width=7, seed=3)
    sets = {"algo.policy_loss": policy_loss}
    with_pass, grads_a = run_update(tiny_model_dir, batch, skip_old_pass=False, **sets)
    old = batch.old_logp.clone()
    skipped, grads_b = run_update(tiny_model_dir, batch, skip_old_pass=True, **sets)
    assert abs(with_pass["pg/loss"] - skipped["pg/loss"]) < TOL
    assert skipped["pg/clip_frac"] == 0.0 and abs(skipped["pg/approx_kl"]) < TOL
    assert grads_a.keys() == grads_b.keys() and grads_a
    for key, g in grads_a.items():
        assert torch.allclose(grads_b[key], g, atol=TOL, rtol=1e-4), key
    # what the skipped pass reported, from the update's forward: |old - rollout| over response tokens
    diff = float(((old - batch.rollout_logp).abs() * batch.mask).sum() / batch.mask.sum())
    assert abs(skipped["rollout/logprob_diff"] - diff) < TOL
    assert skipped["entropy"] > 0


def test_several_steps_per_batch_still_need_the_old_logprobs(tiny_model_dir, process_group):
    from rlctl.recipes.rl.spec import AlgoSpec
    from rlctl.recipes.rl.update import single_step

    batch = group_batch(2, 2, width=4, seed=4)
    assert single_step(batch, AlgoSpec.from_config(rl_config(tiny_model_dir)))
    assert not single_step(batch, AlgoSpec.from_config(rl_config(tiny_model_dir, **{"algo.ppo_epochs": 2})))
    with pytest.raises(ValueError, match="old log-probs"):
        run_update(tiny_model_dir, batch, skip_old_pass=True, **{"algo.ppo_epochs": 2})


def test_packed_rows_attend_per_document_and_match_a_plain_model(tiny_model_dir, process_group, monkeypatch):
    """An SFT packed row (positions restarting at 0, no mask) attends per document (cost: the sum of squared
    document lengths, here in ONE batched sdpa call per layer, the documents padded to the longest), with
    each document's own logits and gradients."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from rlctl.data.packing import collate_packed
    from rlctl.data.sft import Example
    from rlctl.engines import varlen
    from rlctl.engines.fsdp import FSDPEngine

    rng = np.random.default_rng(5)
    docs = [rng.integers(4, 400, size=n) for n in (7, 19, 3, 12)]
    mb = collate_packed([Example(d, d) for d in docs])
    weights = torch.randn(1, mb.input_ids.shape[1], 32, generator=torch.Generator().manual_seed(6))
    engine = FSDPEngine(cpu_spec(rl_config(tiny_model_dir)), total_steps=1)
    engine.train(False)
    calls = []
    sdpa = varlen.F.scaled_dot_product_attention
    monkeypatch.setattr(
        varlen.F, "scaled_dot_product_attention", lambda q, *a, **kw: calls.append(q.shape) or sdpa(q, *a, **kw)
    )
    (logits,) = engine.forward_backward([mb], lambda out, _: ((out[..., :32] * weights).sum(), out))
    layers = engine.hf_config.num_hidden_layers
    assert len(calls) == layers and all(c[0] == len(docs) and c[2] == max(map(len, docs)) for c in calls)
    got_grads = full_grads(engine.model)

    plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="eager")
    plain.eval()
    start = 0
    for d in docs:
        out = plain(input_ids=torch.as_tensor(d, dtype=torch.int64)[None]).logits
        assert torch.allclose(logits[:, start : start + len(d)], out.detach(), atol=TOL, rtol=0)
        (out[..., :32] * weights[:, start : start + len(d)]).sum().backward()
        start += len(d)
    for key, g in full_grads(plain).items():
        assert torch.allclose(got_grads[key], g, atol=TOL, rtol=1e-4), key


def test_eager_attention_keeps_packed_rows_and_still_matches(tiny_model_dir, process_group):
    """Eager attention would add the shared-prefix boolean mask to its scores instead of applying it,
    so an eager engine runs packed rows (no shared prefix), and its log-probs still equal a plain model's."""
    from rlctl.engines.fsdp import FSDPEngine

    batch = group_batch(3, 4, width=9, seed=1)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2)) * batch.mask
    want_logp, _ = plain_reference(tiny_model_dir, batch, weights)
    engine = FSDPEngine(cpu_spec(rl_config(tiny_model_dir), attn="eager"), total_steps=1)
    assert not engine.shares_prefix
    logp, _, _ = engine_pass(engine, batch, weights, budget=10_000, share_prefix=False, split=False)
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
