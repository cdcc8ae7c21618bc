"""CUDA code paths checked on CPU (issue 25): what a first GPU run would hit, found by reading the libraries.

No GPU here. Each test runs rlctl's own code on the CUDA path with the boundary faked and labelled: a recorder
around ``torch.distributed.init_process_group`` (FAKE: CUDA reported available), megatron-core's real module
builder with ``cuda=True`` (no CUDA call is made while building norms), a recorder around sdpa, and
``FakeTensorMode`` (torch's fake tensors: ``device="cuda"`` tensors with shapes and devices but no data) to
run the batch builders, log-prob passes and advantages on "cuda" and catch any tensor left on the CPU.
benchmarks/gpu_check.sh runs the same paths on a real GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


def test_cuda_process_groups_have_gloo_for_cpu_tensors(monkeypatch):
    """FSDP2's CPU offload keeps sharded gradients as CPU DTensors: clip-grad's norm reduction runs on CPU
    tensors, which an NCCL-only group cannot reduce. On CUDA the default group is ``cuda:nccl,cpu:gloo``.
    (FAKE: torch.cuda.is_available and set_device, and init_process_group recorded instead of run.)"""
    import torch.distributed as dist

    from rlctl.runtime import dist as rdist

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw)))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    d = rdist.init_distributed("cuda")
    assert d.device == torch.device("cuda", 0)
    ((backend, kw),) = calls
    assert set(backend.split(",")) == {"cuda:nccl", "cpu:gloo"} and kw["device_id"] == torch.device("cuda", 0)
    calls.clear()
    rdist.init_distributed("cpu")
    assert calls[0][0] == "gloo"


@pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core not installed")
def test_megatron_norms_build_on_cuda_with_sequence_parallel_without_transformer_engine(monkeypatch):
    """Without Transformer Engine (the megatron extra does not install it) the local spec's WrappedTorchNorm
    asserts persist_layer_norm and sequence parallel off (megatron-core 0.16.1, transformer/torch_norm.py),
    while rlctl turned both on for CUDA with tp > 1. Every norm of the layer and the block's final norm now
    builds, its weight marked ``sequence_parallel`` so finalize_model_grads sums its gradient over TP."""
    import megatron.core.transformer.transformer_block as block
    from megatron.core.transformer.spec_utils import build_module

    from rlctl.engines.megatron import config as mcfg

    monkeypatch.setattr(mcfg, "have_transformer_engine", lambda: False)
    monkeypatch.setattr(block, "get_num_layers_to_build", lambda config, *a, **k: 4)  # (no pipeline group here)
    hf = {
        "model_type": "qwen3",
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 256,
        "vocab_size": 300,
        "rms_norm_eps": 1e-5,
    }
    c = mcfg.transformer_config(hf, tp=2, sequence_parallel=True, dtype=torch.bfloat16, cuda=True)
    assert c.sequence_parallel
    spec = mcfg.layer_spec(hf, cuda=True, config=c)
    layer = spec.layer_specs[0].submodules
    attention = layer.self_attention.submodules
    assert len(spec.layer_specs) == 4
    for norm_spec in (layer.input_layernorm, layer.pre_mlp_layernorm, attention.q_layernorm, spec.layer_norm):
        norm = build_module(norm_spec, config=c, hidden_size=128, eps=1e-5)
        assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
        x = torch.randn(3, 128)
        torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def _record_sdpa(monkeypatch) -> list[dict]:
    calls: list[dict] = []
    real = F.scaled_dot_product_attention

    def recorder(q, k, v, attn_mask=None, *args, **kwargs):
        calls.append({"mask": attn_mask is not None, "gqa": kwargs.get("enable_gqa", False), "heads": k.shape[1]})
        return real(q, k, v, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recorder)
    return calls


def test_no_masked_sdpa_call_asks_for_grouped_heads(monkeypatch, tiny_model_dir):
    """sdpa with both a mask and ``enable_gqa`` takes the math kernel on CUDA (fp32 scores, not in the
    estimate): flash takes grouped heads but no mask. The shared-prefix blocks of engines/varlen.py and the
    hf engine's own prefill repeat the KV heads instead; the results are unchanged."""
    from rlctl.engines import varlen
    from rlctl.rollout import RolloutSpec, SamplingParams, make_rollout_engine

    calls = _record_sdpa(monkeypatch)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 12, 16, generator=g) for h in (4, 2, 2))
    blocks = [(0, 0, 4, 0, 0), (0, 4, 8, 0, 4), (0, 8, 12, 0, 4)]  # a prompt, then two responses sharing it
    out, _ = varlen.attention(None, q, k, v, None, scaling=0.25, rlctl_blocks=blocks)
    assert any(c["mask"] for c in calls) and not any(c["mask"] and c["gqa"] for c in calls)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for start, end, p1 in ((0, 4, 0), (4, 8, 4), (8, 12, 4)):  # each block alone, by hand
        keys, values = (
            torch.cat([kk[:, :, :p1], kk[:, :, start:end]], 2),
            torch.cat([vv[:, :, :p1], vv[:, :, start:end]], 2),
        )
        scores = q[:, :, start:end] @ keys.transpose(-1, -2) * 0.25
        scores[..., p1:] = scores[..., p1:].masked_fill(~torch.ones(end - start, end - start).tril().bool(), -torch.inf)
        torch.testing.assert_close(out[0, start:end].transpose(0, 1), (scores.softmax(-1) @ values)[0])

    calls.clear()
    engine = make_rollout_engine(
        RolloutSpec(engine="hf", model_path=str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=64)
    )
    assert engine._fast is not None  # the fast path's own prefill (GQA: 2 heads, 1 KV head)
    engine.generate([[5, 6, 7], [8, 9]], n=2, sampling=SamplingParams(temperature=0, max_tokens=3))
    assert calls and not any(c["mask"] and c["gqa"] for c in calls)


class _FakeActor:
    """A FAKE engine for the log-prob pass: an embedding and a head on ``device``, no FSDP."""

    shares_prefix = True

    def __init__(self, vocab: int, device: str):
        self.embed = torch.zeros(vocab, 8, device=device)
        self.head = torch.zeros(vocab, 8, device=device)

    def train(self, mode: bool = True) -> None:
        pass

    def forward_backward(self, micro, loss_fn, *, forward_only=False):
        out = []
        for mb in micro:
            logits = F.linear(F.embedding(mb.input_ids, self.embed), self.head)  # every position's logits
            out.append(loss_fn(logits, mb)[1])
        return out


def _batch(device: str):
    from rlctl.recipes.rl.batch import RolloutBatch

    prompts = [[5, 6, 7], [5, 6, 7], [9, 10], [9, 10]]
    responses = [[11, 12], [13], [14, 15, 16], [17, 18]]
    logp = [[-1.0] * len(r) for r in responses]
    return RolloutBatch.build(
        prompts, responses, logp, [0, 1, 2, 3], n=2, batch_size=2, mini_batch_size=2, width=4, device=device
    )


@pytest.mark.parametrize("arm", ["cpu-autocast", "cuda-autocast-sdpa"])
def test_per_document_attention_under_bf16_autocast(monkeypatch, arm):
    """On CUDA the policy's forward runs under bf16 autocast with float32 weights: q, k, v are float32 and
    sdpa returns bf16. The blocks' outputs were copied into ``q.new_zeros`` (float32) with ``index_copy``:
    CUDA autocast leaves index_copy alone and it refuses mixed dtypes, so the first GPU run of grpo-tools-hf
    failed there (G4, docs/gpu.md). The zeros now take the kernels' dtype. Two arms: CPU autocast (sdpa
    returns bf16, but CPU autocast promotes index_copy to float32, so the old code returned float32), and
    sdpa FAKED as CUDA autocast runs it (inputs cast to bf16; no autocast around index_copy: the old code
    raised the GPU run's error). Each document's attention computed alone with sdpa in bf16; padding zero."""
    from rlctl.engines import varlen

    real_sdpa = F.scaled_dot_product_attention
    if arm == "cuda-autocast-sdpa":  # FAKE: what CUDA autocast does to sdpa's float32 inputs
        bf16 = lambda *a, **kw: real_sdpa(*(x.bfloat16() for x in a), **kw)  # noqa: E731
        monkeypatch.setattr(varlen.F, "scaled_dot_product_attention", bf16)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 14, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    # row 0: two packed documents, then padding; row 1: a prompt and two responses that share it
    blocks = [(0, 0, 5, 0, 0), (0, 5, 11, 0, 0), (1, 0, 4, 0, 0), (1, 4, 9, 0, 4), (1, 9, 14, 0, 4)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=arm == "cpu-autocast"):
        out, _ = varlen.attention(None, q, k, v, None, scaling=0.25, rlctl_blocks=blocks)
    want = torch.zeros(2, 14, 4, 16, dtype=torch.bfloat16)
    kk, vv = (x.detach().bfloat16().repeat_interleave(2, 1) for x in (k, v))
    for row, start, end, p0, p1 in blocks:  # each document alone: its prompt (if any), then causal
        keys = torch.cat([kk[row, :, p0:p1], kk[row, :, start:end]], 1)
        values = torch.cat([vv[row, :, p0:p1], vv[row, :, start:end]], 1)
        n = end - start
        allowed = torch.ones(n, p1 - p0 + n, dtype=torch.bool)
        allowed[:, p1 - p0 :] = torch.ones(n, n, dtype=torch.bool).tril()
        query = q.detach().bfloat16()[row, :, start:end]
        want[row, start:end] = real_sdpa(query, keys, values, attn_mask=allowed, scale=0.25).transpose(0, 1)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    assert not out[0, 11:].any()  # padding
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32 and q.grad.abs().sum() > 0


def test_the_rollout_batch_is_built_on_cuda():
    """FakeTensorMode (torch's fake tensors: "cuda" tensors with shapes and devices, no data): every tensor of a
    batch built for "cuda" is there, and a CPU tensor mixed in raises, as on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode

    with FakeTensorMode():
        batch = _batch("cuda")
        tensors = [v for v in vars(batch).values() if isinstance(v, torch.Tensor)]
        assert len(tensors) >= 5 and {t.device.type for t in tensors} == {"cuda"}
        with pytest.raises(FakeTensorDeviceMismatchError):
            _ = batch.mask + torch.ones(4, 4)


@pytest.mark.parametrize("share_prefix", [False, True])
def test_passes_and_advantages_keep_everything_on_the_accelerator(share_prefix):
    """The micro-batch builders (packed, shared-prefix), the log-prob pass, the KL and token rewards on the
    "meta" device, a stand-in accelerator (FakeTensorMode's "cuda" tensors cannot be indexed on a CPU-only
    torch): a tensor left on the CPU and mixed in raises "is not on the expected device"."""
    from rlctl.algos.kl import kl_estimate
    from rlctl.recipes.rl.advantages import token_rewards
    from rlctl.recipes.rl.passes import compute_logprobs

    batch = _batch("meta")
    logp, entropy = compute_logprobs(
        _FakeActor(32, "meta"),
        batch,
        temperature=1.0,
        budget=16,
        pad_id=0,
        with_entropy=True,
        share_prefix=share_prefix,
    )
    assert logp.device.type == entropy.device.type == "meta" and logp.shape == (4, 4)
    batch.scores = torch.ones(4, device="meta")
    rewards = token_rewards(batch, kl_coef=0.1, kl=kl_estimate(logp, batch.rollout_logp, "low_var_kl"))
    assert rewards.device.type == "meta" and rewards.shape == (4, 4)  # (advantages: torch.unique has no meta kernel)
    with pytest.raises(RuntimeError, match="not on the expected device"):
        _ = batch.mask + torch.ones(4, 4)
