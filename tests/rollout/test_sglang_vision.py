"""The SGLang adapter's image path. SGLang cannot be installed here: FakeSGLangVL is a FAKE OF THE
sglang.Engine BOUNDARY (it records the request); the test checks the request the adapter builds against
SGLang's documented "processor_output" format, not SGLang itself."""

from __future__ import annotations

import pytest
import torch

from rlctl.rollout import make_rollout_engine
from rlctl.rollout.base import SamplingParams
from rlctl.rollout.spec import RolloutSpec
from tests.rollout.test_rollout import FakeSGLangEngine
from tests.support.vlm_rl import vl_prompt


class FakeSGLangVL(FakeSGLangEngine):
    """Takes image_data too (one entry per request), as sglang.Engine.generate does, and ``sampling_params["n"]``
    as SGLang's parallel sampling does (tokenizer_manager._handle_batch_request: each request processed once,
    then its n copies, prompt-major)."""

    def generate(self, input_ids, sampling_params, return_logprob, image_data=None):
        self.calls.append(("images", image_data))
        n = sampling_params.get("n", 1) if isinstance(sampling_params, dict) else 1
        return super().generate([p for p in input_ids for _ in range(n)], sampling_params, return_logprob)


@pytest.fixture
def fake_sglang_vl(monkeypatch):
    import rlctl.rollout.sglang as adapter

    FakeSGLangEngine.instances.clear()
    monkeypatch.setattr(adapter, "_import_engine_class", lambda: FakeSGLangVL)
    return FakeSGLangVL


def test_sglang_sends_each_prompts_processor_output(fake_sglang_vl, tiny_vl_model_dir):
    from transformers import AutoTokenizer

    from rlctl.data.vision import load_processor

    vp = load_processor(str(tiny_vl_model_dir), AutoTokenizer.from_pretrained(tiny_vl_model_dir))
    engine = make_rollout_engine(
        RolloutSpec(engine="sglang", model_path=str(tiny_vl_model_dir), device="cpu", dtype="bf16", max_model_len=256)
    )
    fake = fake_sglang_vl.instances[0]
    assert fake.kwargs["skip_tokenizer_init"] is False  # a VL model's processor needs its tokenizer
    a = vl_prompt(vp, "red", (56, 56), "Which colour?")
    text = vp.tokenizer("plain")["input_ids"]
    samples = engine.generate([a[0], text], 2, SamplingParams(max_tokens=3), images=[a[1], None])
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    (_, image_data), (_, input_ids, params, _) = fake.calls[-2:]
    assert input_ids == [a[0], a[0], text, text] and params["n"] == 2  # SGLang's expansion, prompt-major
    assert len(image_data) == 2 and image_data[1] is None  # each prompt's images sent once
    (item,) = image_data[0]
    assert item["format"] == "processor_output"
    # the trainer's pixels in the engine's dtype (bf16): what its vision tower casts them to
    assert item["pixel_values"].dtype == torch.bfloat16
    torch.testing.assert_close(item["pixel_values"], torch.as_tensor(a[1][0]).to(torch.bfloat16), rtol=0, atol=0)
    assert item["image_grid_thw"].dtype == torch.long and item["image_grid_thw"].tolist() == a[1][1].tolist()
    assert item["input_ids"].tolist() == [a[0]]
