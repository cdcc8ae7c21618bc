"""The hf rollout engine with images: the log-probs it reports equal a plain transformers forward of the same
model on the same image and tokens, whatever the padding and the group size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlctl.rollout import make_rollout_engine
from rlctl.rollout.base import SamplingParams
from rlctl.rollout.spec import RolloutSpec
from tests.support.vlm_rl import reference_logprobs, vl_prompt


@pytest.fixture(scope="module")
def engine_and_processor(tiny_vl_model_dir):
    from transformers import AutoTokenizer

    from rlctl.data.vision import load_processor

    engine = make_rollout_engine(
        RolloutSpec(engine="hf", model_path=str(tiny_vl_model_dir), dtype="float32", max_model_len=256)
    )
    vp = load_processor(str(tiny_vl_model_dir), AutoTokenizer.from_pretrained(tiny_vl_model_dir))
    return engine, vp


@pytest.mark.parametrize("fast", [True, False], ids=["fast decode step", "generic loop"])
def test_hf_engine_logprobs_with_images_equal_a_plain_forward(engine_and_processor, fast):
    engine, vp = engine_and_processor
    assert engine.vision and engine._fast is not None  # Qwen2-VL's text model is one the fast step covers
    engine.fast_decode = fast
    # two prompts of different lengths (left padding) and image sizes, plus one without an image
    a = vl_prompt(vp, "red", (56, 56), "Which colour?")
    b = vl_prompt(vp, "green", (112, 56), "Which colour fills more of the picture?")
    text = vp.tokenizer("plain text prompt")["input_ids"]
    prompts, images = [a[0], b[0], text], [a[1], b[1], None]
    samples = engine.generate(prompts, 3, SamplingParams(temperature=1.0, max_tokens=12, seed=1), images=images)
    assert [s.prompt_index for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert len({tuple(s.token_ids) for s in samples[:3]}) > 1  # a group samples different responses
    for s in samples:
        ids, pixels = prompts[s.prompt_index], images[s.prompt_index]
        if pixels is None:
            with torch.no_grad():
                logits = engine.model(input_ids=torch.tensor([ids + s.token_ids])).logits[0]
            ref = logits[len(ids) - 1 : -1].log_softmax(-1)[torch.arange(len(s.token_ids)), torch.tensor(s.token_ids)]
            ref = ref.tolist()
        else:
            with torch.no_grad():
                ref = reference_logprobs(engine.model, ids, s.token_ids, pixels).tolist()
        np.testing.assert_allclose(s.logprobs, ref, atol=1e-5)
    engine.fast_decode = True


def test_images_need_an_engine_that_takes_them(engine_and_processor, tiny_model_dir):
    from rlctl.errors import UserError

    engine, vp = engine_and_processor
    ids, pixels = vl_prompt(vp, "red", (56, 56), "Which colour?")
    text_engine = make_rollout_engine(RolloutSpec(engine="hf", model_path=str(tiny_model_dir), max_model_len=256))
    with pytest.raises(UserError, match="no vision tower"):
        text_engine.generate([ids], 1, SamplingParams(max_tokens=2), images=[pixels])


def test_vision_tokens_are_never_sampled_and_keep_the_unfiltered_logprob():
    from rlctl.rollout.hf import sample_next_token

    logits = torch.zeros(64, 10)
    logits[:, 7] = 20.0  # a vision token, by far the most likely
    banned = torch.tensor([7, 8])
    for sampling in (SamplingParams(temperature=1.0), SamplingParams(temperature=0)):
        tokens, logprobs = sample_next_token(logits, sampling, torch.Generator().manual_seed(0), banned)
        assert not set(tokens.tolist()) & {7, 8}
        want = logits.log_softmax(-1)[torch.arange(64), tokens]
        torch.testing.assert_close(logprobs, want)


def test_fast_decode_passes_the_three_rope_axes_that_transformers_5_17_requires(tiny_vl_model_dir, monkeypatch):
    """Found on the first GPU run (H200, transformers 5.17): Qwen2-VL's text rotary embedding there indexes
    ``position_ids[:, :, None, :]`` (3 axes x batch x positions), so the fast decode step's 2-D position ids
    raised IndexError when the engine was built. The installed (newer) transformers also broadcasts 2-D ids;
    here its forward is wrapped to index them as 5.17 does, and the engine must build, keep the fast step and
    report the log-probs of a plain forward."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    from rlctl.data.vision import load_processor

    original = modeling_qwen2_vl.Qwen2VLRotaryEmbedding.forward

    def forward_as_in_5_17(self, x, position_ids):
        position_ids[:, :, None, :]  # transformers 5.17's first use of the ids: IndexError on 2-D ids
        return original(self, x, position_ids)

    monkeypatch.setattr(modeling_qwen2_vl.Qwen2VLRotaryEmbedding, "forward", forward_as_in_5_17)
    engine = make_rollout_engine(
        RolloutSpec(engine="hf", model_path=str(tiny_vl_model_dir), dtype="float32", max_model_len=256)
    )
    assert engine._fast is not None
    vp = load_processor(str(tiny_vl_model_dir), AutoTokenizer.from_pretrained(tiny_vl_model_dir))
    ids, pixels = vl_prompt(vp, "red", (56, 56), "Which colour?")
    samples = engine.generate([ids], 2, SamplingParams(temperature=1.0, max_tokens=8, seed=3), images=[pixels])
    for s in samples:
        with torch.no_grad():
            ref = reference_logprobs(engine.model, ids, s.token_ids, pixels).tolist()
        np.testing.assert_allclose(s.logprobs, ref, atol=1e-5)
