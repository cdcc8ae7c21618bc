"""The hf engine's fast decode step (rlctl.rollout.hf_decode) against the plain HF model.

The reference is always an independent HF model: its full-sequence forward over prompt + response (no
cache, no padding), or the engine's generic loop (the HF forward with a DynamicCache) for the same seed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import rlctl.rollout.hf as hf
from rlctl.rollout import RolloutSpec, SamplingParams, make_rollout_engine
from rlctl.rollout.hf_decode import DecodeState, FastDecoder
from rlctl.testing import TINY_TEXT_SIZES, build_tiny_model

# different lengths, so left padding matters; with MAX_MODEL_LEN the budgets differ per prompt too
PROMPTS = [[5, 17, 33, 8], [100, 7, 250, 61, 90, 4, 12], [42, 43]]
MAX_MODEL_LEN = 24
STOPS = list(range(3, 500, 20))  # about one token in twenty stops: rows finish at different steps


def _overwrite_model(path: Path, config_class, *, seed: int, **overrides) -> Path:
    """Replace the Qwen2 weights of a build_tiny_model directory by another architecture's (same tokenizer)."""
    base = AutoConfig.from_pretrained(path)
    config = config_class(
        vocab_size=base.vocab_size,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        initializer_range=0.1,
        max_position_embeddings=512,
        **overrides,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path


def _qwen2(path: Path, seed: int = 0, **overrides) -> Path:
    # q/k/v biases, 4 query heads on 2 KV heads, head_dim 64; logits of a few units (fp32 sums stay within 1e-5)
    kwargs = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384)
    return build_tiny_model(path, seed=seed, initializer_range=0.05, **{**kwargs, **overrides})


def _qwen3(path: Path) -> Path:
    from transformers import Qwen3Config

    build_tiny_model(path, seed=0)
    small = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32)
    return _overwrite_model(
        path, Qwen3Config, seed=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **small
    )


def _llama(path: Path) -> Path:
    from transformers import LlamaConfig

    build_tiny_model(path, seed=0)
    # llama3 rope scaling that is active at these positions, biases everywhere, 4 query heads on 1 KV head
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return _overwrite_model(
        path,
        LlamaConfig,
        seed=3,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters=rope,
    )


def _mistral(path: Path) -> Path:
    from transformers import MistralConfig

    build_tiny_model(path, seed=0)
    # the default sliding window (4096) is longer than any sequence here: the fast path applies
    return _overwrite_model(
        path,
        MistralConfig,
        seed=4,
        **TINY_TEXT_SIZES,
    )


BUILDERS = {"qwen2": _qwen2, "qwen3": _qwen3, "llama": _llama, "mistral": _mistral}


@pytest.fixture(scope="module", params=list(BUILDERS))
def arch_model(request, tmp_path_factory) -> Path:
    return BUILDERS[request.param](tmp_path_factory.mktemp("decode") / request.param)


def _engine(path: Path, **kwargs):
    kwargs = {"device": "cpu", "dtype": "float32", "max_model_len": MAX_MODEL_LEN, **kwargs}
    return make_rollout_engine(RolloutSpec(engine="hf", model_path=str(path), **kwargs))


def _generate_recording(engine, sampling: SamplingParams, n: int, monkeypatch) -> tuple[list, list[torch.Tensor]]:
    """Samples, and the logits each decode step handed to the sampler (rows: the unfinished samples)."""
    seen: list[torch.Tensor] = []
    sample = hf.sample_next_token

    def recording(logits, *args):
        seen.append(logits.detach().clone())
        return sample(logits, *args)

    monkeypatch.setattr(hf, "sample_next_token", recording)
    samples = engine.generate(PROMPTS, n=n, sampling=sampling)
    monkeypatch.setattr(hf, "sample_next_token", sample)
    return samples, seen


@pytest.mark.parametrize("variant", ["compact-packed", "masked-unpacked"])
def test_fast_logits_equal_full_forward(arch_model, variant, monkeypatch):
    # finished rows dropped at once or kept to the end; every product by oneDNN (prepacked) or none
    monkeypatch.setattr(DecodeState, "COMPACT_ROW_STEPS", 0 if variant.startswith("compact") else 10**9)
    monkeypatch.setattr(FastDecoder, "PACK_MIN_NUMEL", 0 if variant.endswith("-packed") else 10**12)
    reference = AutoModelForCausalLM.from_pretrained(arch_model, dtype=torch.float32).eval()
    with _engine(arch_model) as engine:
        assert engine._fast is not None
        sampling = SamplingParams(temperature=1.0, max_tokens=20, stop_token_ids=STOPS, seed=0)
        samples, seen = _generate_recording(engine, sampling, 3, monkeypatch)
    lengths = [len(s.token_ids) for s in samples]
    assert len(set(lengths)) > 3  # rows finished at many different steps
    assert any(s.finish_reason == "stop" for s in samples) and any(s.finish_reason == "length" for s in samples)
    assert len(seen) == max(lengths)
    with torch.no_grad():
        for step, logits in enumerate(seen):
            rows = [s for s in samples if len(s.token_ids) > step]  # the samples still decoding, in order
            assert logits.shape[0] == len(rows)
            for row, s in enumerate(rows):
                prompt = PROMPTS[s.prompt_index]
                full = reference(torch.tensor([prompt + s.token_ids[:step]])).logits[0, -1]
                torch.testing.assert_close(logits[row], full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("packed", [True, False])
def test_fast_prefill_equals_hf_forward(arch_model, packed, monkeypatch):
    # the fast path's own prefill: left padding of different lengths, logits at each prompt's last token
    # and the keys/values in every one of a prompt's n rows, against the HF model's forward and cache
    monkeypatch.setattr(FastDecoder, "PACK_MIN_NUMEL", 0 if packed else 10**12)
    prompts = [list(range(7, 27)), [5, 17, 33, 8], [300 + i for i in range(13)], [42]]
    with _engine(arch_model) as engine, torch.inference_mode():
        input_ids, mask = hf.left_pad(prompts, 0, torch.device("cpu"))
        state = engine._fast.start([len(p) for p in prompts], 2, 4)
        logits = state.prefill(input_ids)
        for row, prompt in enumerate(prompts):
            out = engine.model(torch.tensor([prompt]), use_cache=True)
            torch.testing.assert_close(logits[row], out.logits[0, -1], atol=1e-5, rtol=0)
            for layer, cached in enumerate(out.past_key_values.layers):
                for sample in (2 * row, 2 * row + 1):
                    got = state.kv[layer, :, sample, :, input_ids.shape[1] - len(prompt) : input_ids.shape[1]]
                    torch.testing.assert_close(got[0], cached.keys[0], atol=1e-5, rtol=0)
                    torch.testing.assert_close(got[1], cached.values[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_fast_equals_generic_loop(arch_model, temperature):
    sampling = SamplingParams(temperature=temperature, top_k=50, max_tokens=20, stop_token_ids=STOPS, seed=7)
    with _engine(arch_model) as engine:
        fast = engine.generate(PROMPTS, n=3, sampling=sampling)
        engine.fast_decode = False
        generic = engine.generate(PROMPTS, n=3, sampling=sampling)
    assert [s.token_ids for s in fast] == [s.token_ids for s in generic]
    assert [s.finish_reason for s in fast] == [s.finish_reason for s in generic]
    for a, b in zip(fast, generic, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_fast_bf16_first_steps_close_to_generic_loop(monkeypatch, tmp_path):
    # bf16 rounds differently in the two paths (their prefill and attention differ), so compare the
    # logits of the prefill and the first decode steps (same tokens fed: greedy) at a bf16 tolerance
    path = _qwen3(tmp_path / "qwen3")
    sampling = SamplingParams(temperature=0, max_tokens=3)
    with _engine(path, dtype="bfloat16") as engine:
        assert engine.model.dtype == torch.bfloat16
        _, fast = _generate_recording(engine, sampling, 1, monkeypatch)
        engine.fast_decode = False
        _, generic = _generate_recording(engine, sampling, 1, monkeypatch)
    assert len(fast) == len(generic) == 3
    torch.testing.assert_close(fast[0].float(), generic[0].float(), atol=0.1, rtol=0.02)  # the prefill
    torch.testing.assert_close(fast[1].float(), generic[1].float(), atol=0.1, rtol=0.02)
    assert not torch.equal(fast[1], fast[0])


def test_fast_path_sees_updated_weights(tmp_path):
    path_a, path_b = _qwen2(tmp_path / "a", seed=0), _qwen2(tmp_path / "b", seed=1)
    sampling = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    new_weights = AutoModelForCausalLM.from_pretrained(path_b, dtype=torch.float32).state_dict()
    with _engine(path_a) as engine, _engine(path_b) as fresh:
        before = engine.generate(PROMPTS, n=2, sampling=sampling)
        engine.update_weights((name, t.clone()) for name, t in new_weights.items())
        after = engine.generate(PROMPTS, n=2, sampling=sampling)
        expected = fresh.generate(PROMPTS, n=2, sampling=sampling)
        # the fused QKV weight is the storage of q_proj/k_proj/v_proj: it holds the new weights
        attn = engine.model.model.layers[1].self_attn
        fused = torch.cat([new_weights[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(engine._fast.layers[1].qkv.weight, fused)
        assert attn.q_proj.weight.data_ptr() == engine._fast.layers[1].qkv.weight.data_ptr()
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    assert [s.token_ids for s in after] == [s.token_ids for s in expected]
    for a, b in zip(after, expected, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def _reference_logprobs(path: Path, samples, temperature: float) -> list[torch.Tensor]:
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in samples:
            prompt = PROMPTS[s.prompt_index]
            logits = reference(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
            out.append((logits / temperature).log_softmax(-1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0])
    return out


def test_unsupported_config_falls_back_and_says_why_once(tmp_path, caplog):
    path = _qwen2(tmp_path / "gelu", hidden_act="gelu")
    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    with caplog.at_level(logging.INFO, logger="rlctl.rollout.hf"), _engine(path) as engine:
        assert engine._fast is None
        samples = engine.generate(PROMPTS, n=2, sampling=sampling)
        engine.generate(PROMPTS, n=2, sampling=sampling)
    said = [r.getMessage() for r in caplog.records if "generic decoding loop" in r.getMessage()]
    assert len(said) == 1 and "hidden_act 'gelu' is not silu" in said[0]
    for s, expected in zip(samples, _reference_logprobs(path, samples, 1.0), strict=True):
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)


def test_sliding_window_shorter_than_the_sequences_falls_back(tmp_path, caplog):
    # every layer windowed (max_window_layers 0) to 8 tokens: the fast path cannot apply to longer sequences
    path = _qwen2(tmp_path / "sw", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    sampling = SamplingParams(temperature=1.0, max_tokens=10, seed=0)
    with caplog.at_level(logging.INFO, logger="rlctl.rollout.hf"), _engine(path) as engine:
        assert engine._fast is not None and engine._fast.window == 8
        samples = engine.generate(PROMPTS, n=2, sampling=sampling)
        engine.generate(PROMPTS, n=2, sampling=sampling)
    said = [r.getMessage() for r in caplog.records if "generic decoding loop" in r.getMessage()]
    assert len(said) == 1 and "sliding window 8" in said[0]
    for s, expected in zip(samples, _reference_logprobs(path, samples, 1.0), strict=True):
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)
