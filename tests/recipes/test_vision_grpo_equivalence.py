"""GRPO's passes for a vision-language model (tiny Qwen2-VL, fp32): shared prefix on and off, packed or not,
give each sample's log-probs and the gradients of a weighted sum of them as a plain transformers forward of
that prompt (its image) and response alone (1e-5)."""

from __future__ import annotations

import pytest
import torch

from tests.recipes.test_speed_equivalence import TEMPERATURE, TOL, engine_pass, full_grads, rl_config
from tests.support.vlm_rl import reference_logprobs, vl_group_batch


@pytest.fixture(scope="module")
def vision(tiny_vl_model_dir):
    from transformers import AutoTokenizer

    from rlctl.data.vision import load_processor

    return load_processor(str(tiny_vl_model_dir), AutoTokenizer.from_pretrained(tiny_vl_model_dir))


def plain_vl_reference(model_dir, batch, weights):
    """Each sample alone through plain transformers (its prompt's image, get_rope_index positions)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    logp = torch.zeros_like(batch.mask)
    for i in range(len(batch)):
        p, r, meta = batch.prompts[i], batch.responses[i], batch.meta[i]
        lp = reference_logprobs(model, p, r, (meta.pixel_values, meta.image_grid_thw), TEMPERATURE)
        (lp * weights[i, : len(r)]).sum().backward()
        logp[i, : len(r)] = lp.detach()
    return logp, full_grads(model)


def test_shared_prefix_on_and_off_match_a_plain_vl_model(tiny_vl_model_dir, vision, process_group):
    from rlctl.engines.fsdp import FSDPEngine
    from tests.support.sft import cpu_spec

    batch = vl_group_batch(vision, 3, 3, width=6, seed=1)
    weights = torch.randn(batch.mask.shape, generator=torch.Generator().manual_seed(2)) * batch.mask
    want_logp, want_grads = plain_vl_reference(tiny_vl_model_dir, batch, weights)
    cfg = rl_config(tiny_vl_model_dir, **{"rollout.max_prompt_len": 64})
    engine = FSDPEngine(cpu_spec(cfg), total_steps=1)
    assert engine.vision and engine.shares_prefix
    longest = max(batch.lengths)
    settings = {
        "shared prefix, one micro-batch": dict(budget=10_000, share_prefix=True, split=False),
        "shared prefix, a micro-batch per group or less": dict(budget=longest, share_prefix=True, split=False),
        "packed rows": dict(budget=2 * longest, share_prefix=False, split=False),
        "one sample per micro-batch": dict(budget=longest, share_prefix=False, split=False),
    }
    trained = {k for k in want_grads if ".visual." not in k}  # the vision tower is frozen (no gradients)
    for name, kw in settings.items():
        logp, grads, micro = engine_pass(engine, batch, weights, **kw)
        assert torch.allclose(logp, want_logp, atol=TOL, rtol=0), (name, (logp - want_logp).abs().max())
        assert grads.keys() == trained, name
        for key in trained:
            assert torch.allclose(grads[key], want_grads[key], atol=TOL, rtol=1e-4), f"{name}: {key}"
        if kw["share_prefix"] and kw["budget"] == 10_000:  # each group's prompt and image once
            (mb,) = micro
            assert mb.input_ids.shape[0] == 3 and len(mb.image_grid_thw) == 3
