"""The estimator's memory options, each against a hand-worked count for Qwen2.5-7B
(P = 7,615,616,512 parameters, h 3584, f 18944, 28 layers, vocabulary 152,064)."""

from __future__ import annotations

import pytest

from rlctl.catalog import resolve_gpu, resolve_model
from rlctl.catalog.spec import GpuSpec
from rlctl.errors import UserError
from rlctl.estimate import MemorySettings, estimate_memory
from rlctl.estimate.settings import ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES, GIB

P7 = 7_615_616_512
H, F, L, V = 3584, 18944, 28, 152064
BIG = GpuSpec("test-1TB", 10**12, 0.0, "NVLink", 0.0, 8)


def est(gpu=BIG, **kw):
    return estimate_memory(resolve_model("Qwen2.5-7B"), gpu, MemorySettings(**kw))


def train(e):
    return e.phases["training"].components


def test_pure_bf16_keeps_8_bytes_per_parameter():
    mixed, pure = train(est(method="sft", gpus=8)), train(est(method="sft", gpus=8, precision="bf16"))
    assert (mixed["weights"], mixed["gradients"], mixed["optimizer_states"]) == (4 * P7 // 8, 4 * P7 // 8, P7)
    assert (pure["weights"], pure["gradients"], pure["optimizer_states"]) == (2 * P7 // 8, 2 * P7 // 8, P7 // 2)
    with pytest.raises(UserError, match=r"needs model.dtype=bf16, not fp32; set model.dtype=bf16"):
        est(method="sft", precision="bf16", dtype="fp32")
    with pytest.raises(UserError, match="megatron engine has no pure-bf16"):
        est(method="sft", gpus=8, backend="megatron", precision="bf16")


def test_one_gpu_without_sharding_has_no_gather_buffers():
    sharded, plain = train(est(method="sft")), train(est(method="sft", shard=False))
    assert sharded["unsharded_buffers"] > 0 and plain["unsharded_buffers"] == 0
    assert {k: v for k, v in sharded.items() if k != "unsharded_buffers"} == {
        k: v for k, v in plain.items() if k != "unsharded_buffers"
    }
    with pytest.raises(UserError, match="runs on one GPU"):
        est(method="sft", gpus=2, shard=False)


def test_token_budget_sets_the_tokens_per_micro_batch():
    # no checkpointing: activations are linear in the tokens of a micro batch
    one = train(est(method="sft", max_len=4096, activation_checkpointing=False))["activations"]
    budget = train(est(method="sft", max_len=4096, activation_checkpointing=False, micro_batch_tokens=8192))
    assert budget["activations"] == 2 * one
    assert budget["logits"] == 8192 * V * (2 + 2 + 4 + 4)


def test_selective_checkpointing_recomputes_the_mlps():
    t = 4096
    none = train(est(method="sft", max_len=t, activation_checkpointing=False))["activations"]
    sel = train(est(method="sft", max_len=t, activation_checkpointing=False, selective_checkpointing=True))
    mlp = t * 2 * 4 * F  # gate, up, activation and product in bf16 per layer
    assert none - sel["activations"] == (L - 1) * mlp  # 28 layers drop their MLP values, one is recomputed


def test_activation_offload_keeps_two_inputs_and_one_layer():
    t = 4096
    full = train(est(method="sft", max_len=t))["activations"]  # 28 inputs + one layer recomputed
    off = est(method="sft", max_len=t, offload_activations=True)
    assert full - train(off)["activations"] == (L - 2) * t * H * 2
    assert off.host_phases["training"].components["offloaded_activations"] == full


def test_chunked_loss_counts_one_chunk_of_response_positions():
    rl = {"method": "grpo", "prompt_len": 512, "response_len": 1024, "rollout": "hf", "micro_batch": 2}
    unfused = train(est(**rl))["logits"]
    # the response positions only (the engines pass logits_to_keep; measured on the first GPU run, where
    # counting every position put the GRPO estimate 3.1 GB high): bf16 logits + grad, fp32 log-softmax + grad
    assert unfused == 2 * 1024 * V * 12
    sft = train(est(method="sft", max_len=1536, micro_batch=2))["logits"]
    assert sft == 2 * 1536 * V * 12  # SFT's loss reads every position
    assert train(est(**rl, loss_chunk=512))["logits"] == 512 * V * (2 + 12)
    # a chunk larger than the response positions (2 x 1024) holds only them
    assert train(est(**rl, loss_chunk=4096))["logits"] == 2 * 1024 * V * (2 + 12)


def test_reference_model_off_without_kl_and_the_reward_model_line():
    rl = {"method": "grpo", "gpus": 8, "rollout": "hf"}
    assert train(est(**rl))["reference_model"] == 2 * P7 // 8
    assert train(est(**rl, kl=False))["reference_model"] == 0
    # rlctl.rewards.model: a whole replica on every rank in reward.model_dtype (fp32 by default), awake in both
    # phases, offload or not (it was counted sharded over the 8 GPUs in bf16: 16x too little)
    for dtype, size in (("fp32", 4), ("bf16", 2)):
        for offload in (False, True):
            e = est(**rl, reward_model=True, reward_model_dtype=dtype, offload_params=offload)
            assert train(e)["reward_model"] == e.phases["rollout"].components["reward_model"] == size * P7
    with pytest.raises(UserError, match="reward_model_dtype='int8'"):
        est(**rl, reward_model=True, reward_model_dtype="int8")


def test_the_hf_engine_keeps_its_weights_through_the_update():
    """The hf rollout engine cannot sleep: its private bf16 copy of the model stays on the GPU while the trainer
    updates. vLLM and SGLang release theirs."""
    hf = est(method="grpo", gpus=8, rollout="hf")
    assert train(hf)["engine_weights"] == hf.phases["rollout"].components["engine_weights"] == 2 * P7
    assert "kv_cache" not in train(hf)  # allocated only while it generates
    for engine in ("vllm", "sglang"):
        assert "engine_weights" not in train(est(method="grpo", gpus=8, rollout=engine, mem_fraction=0.5))


def test_allocated_reserved_device_and_the_verdict_on_the_device_figure():
    e = est(method="sft", gpus=8)
    phase, parts = e.phases["training"], train(e)
    allocated = sum(v for k, v in parts.items() if k != "cuda_context")
    transient = parts["activations"] + parts["logits"] + parts["unsharded_buffers"]
    assert phase.allocated_bytes == allocated
    assert phase.reserved_bytes == allocated + round(ALLOCATOR_SLACK * transient)
    assert phase.total_bytes == phase.reserved_bytes + CUDA_CONTEXT_BYTES
    # a GPU that holds the allocated peak but not reserved + context: does not fit
    tight = GpuSpec("tight", phase.allocated_bytes + GIB // 4, 0.0, "NVLink", 0.0, 8)
    verdict = estimate_memory(resolve_model("Qwen2.5-7B"), tight, MemorySettings(method="sft", gpus=8))
    assert not verdict.fits and verdict.verdict.startswith("does not fit")
    assert "allocated" in e.verdict and "reserved" in e.verdict


def test_unsupported_parallelism_is_named_not_pretended():
    with pytest.raises(UserError, match="FSDP\\+TP is not built"):
        est(method="sft", gpus=8, tp=2)
    with pytest.raises(UserError, match="context parallelism"):
        est(method="sft", gpus=8, cp=2)
    assert est(method="sft", gpus=8, backend="megatron", tp=2, cp=2).fits


@pytest.mark.parametrize(
    ("name", "gib"),
    [("H20", 95.0), ("A800", 79.2), ("H800", 79.2), ("H100-96GB", 95.6), ("L40S", 44.5), ("A6000", 47.5)],
)
def test_gpu_types(name, gib):
    assert round(resolve_gpu(name).memory_bytes / GIB, 1) == gib
