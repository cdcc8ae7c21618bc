"""The memory estimator, term by term, against hand-worked arithmetic and real tensors.

Hand-worked numbers are written out as the arithmetic that produces them (Qwen2.5-7B: hidden 3584,
MLP 18944, 28 layers, 28 heads, 4 KV heads of 128, vocabulary 152064, 7,615,616,512 parameters).
Real-tensor checks build transformers models on the meta device (or tiny ones on CPU) and sum
``numel * element_size`` of the tensors torch actually creates.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from rlctl.catalog import count_params, list_models, resolve_model
from rlctl.catalog.count import vision_params
from rlctl.catalog.spec import GpuSpec
from rlctl.errors import UserError
from rlctl.estimate import MemorySettings, estimate_memory
from rlctl.estimate.inventory import expert_params, layer_kinds, lora_params, tensors
from rlctl.estimate.memory import (
    CUDA_CONTEXT_BYTES,
    ENGINE_GRAPH_BYTES,
    engine_activation_bytes,
    kv_bytes_per_token,
    pipeline_split,
)

P7 = 7_615_616_512  # Qwen2.5-7B parameters
H, F, L, V = 3584, 18944, 28, 152064
LAYER7 = 233_057_792  # one Qwen2.5-7B decoder layer
BIG = GpuSpec("test-1TB", 10**12, 0.0, "NVLink", 0.0, 8)


def qwen7():
    return resolve_model("Qwen2.5-7B")


def est(model="Qwen2.5-7B", gpu=BIG, **kw):
    return estimate_memory(resolve_model(model), gpu, MemorySettings(**kw))


def train(e):
    return e.phases["training"].components


def rollout(e):
    return e.phases["rollout"].components


# ---------------------------------------------------------------------------------------------
# Parameter inventory


def test_layer_params_by_hand():
    attention = 3584 * (3584 + 2 * 512) + (3584 + 2 * 512) + 3584 * 3584  # q,k,v with biases, o
    mlp = 3 * 3584 * 18944
    norms = 2 * 3584
    assert attention + mlp + norms == LAYER7
    assert 152064 * 3584 * 2 + 28 * LAYER7 + 3584 == P7  # embedding + head + layers + final norm


@pytest.mark.parametrize("spec", list_models(), ids=lambda s: s.name)
def test_inventory_adds_up_to_catalog_count(spec):
    layers = sum(layer.total * n for layer, n in layer_kinds(spec))
    head = 0 if spec.tie_embeddings else spec.vocab_size * spec.hidden_size
    vision = vision_params(spec)  # a VL model's vision tower, beside the decoder
    assert spec.vocab_size * spec.hidden_size + layers + spec.hidden_size + head + vision == count_params(spec)
    assert sum(t.rows * t.cols * t.count for t in tensors(spec)) == count_params(spec)


TINY = {
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=100,
    ),
    "llama": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=120,
    ),
    "gemma2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=100,
    ),
    "qwen3_moe": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=100,
    ),
    "deepseek_v3": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=100,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
    ),
}


def _hf_meta(model_type: str, **kw):
    """A transformers model of this architecture on the meta device, and its ModelSpec."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlctl.catalog.hf_config import spec_from_hf_config

    config = AutoConfig.for_model(model_type, **kw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, spec_from_hf_config(config.to_dict(), source="test", name=f"tiny-{model_type}")


@pytest.mark.parametrize("arch", list(TINY))
def test_inventory_groups_match_hf_parameters(arch):
    model, spec = _hf_meta(arch, **TINY[arch])
    numel = {name: p.numel() for name, p in model.named_parameters()}
    assert sum(numel.values()) == count_params(spec)
    experts = sum(n for name, n in numel.items() if ".mlp.experts." in name)
    assert experts == expert_params(spec)
    routers = sum(n for name, n in numel.items() if name.endswith("mlp.gate.weight"))
    assert routers == sum(layer.router * n for layer, n in layer_kinds(spec))


# ---------------------------------------------------------------------------------------------
# Model states


def test_fsdp_full_shard_model_states_by_hand():
    c = train(est(gpus=8, method="grpo"))
    assert c["weights"] == P7 * 4 // 8  # fp32 master, sharded
    assert c["gradients"] == P7 * 4 // 8
    assert c["optimizer_states"] == P7 * 8 // 8  # AdamW m and v in fp32
    assert c["weights"] + c["gradients"] + c["optimizer_states"] == 7_615_616_512 * 16 // 8 == 15_231_233_024


def test_model_states_equal_real_tensors_after_an_adamw_step():
    """A tiny fp32 model trained one step on CPU: its params, grads and AdamW states, as torch makes them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlctl.catalog.hf_config import spec_from_hf_config

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", **TINY["qwen2"])
    model = AutoModelForCausalLM.from_config(config).float()
    ids = torch.randint(0, 100, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    moments = sum(
        t.numel() * t.element_size()
        for state in opt.state.values()
        for key, t in state.items()
        if key in ("exp_avg", "exp_avg_sq")
    )
    bf16 = sum(p.numel() * 2 for p in model.to(torch.bfloat16).parameters())

    spec = spec_from_hf_config(config.to_dict(), source="test", name="tiny")
    fsdp = train(estimate_memory(spec, BIG, MemorySettings(method="sft", gpus=1, max_len=8)))
    assert (fsdp["weights"], fsdp["gradients"], fsdp["optimizer_states"]) == (params, grads, moments)
    megatron = train(estimate_memory(spec, BIG, MemorySettings(method="sft", gpus=1, backend="megatron", max_len=8)))
    assert megatron["weights"] == bf16  # bf16 parameters
    assert megatron["gradients"] == grads  # fp32 main grads
    assert megatron["optimizer_states"] == params + moments  # fp32 master + m + v (dp 1)


def test_fsdp_shard_of_the_real_7b_on_meta():
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlctl.catalog import hf_config_dict

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**hf_config_dict(qwen7())))
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    c = train(est(gpus=8, method="sft"))
    assert c["weights"] == math.ceil(fp32 / 8)
    assert c["optimizer_states"] == math.ceil(2 * fp32 / 8)


def test_megatron_distributed_optimizer_by_hand():
    p32 = count_params(resolve_model("Qwen2.5-32B"))
    c = train(est("Qwen2.5-32B", gpus=8, backend="megatron", tp=8, sequence_parallel=True))
    shard = math.ceil(p32 / 8)
    assert c["weights"] == 2 * shard  # bf16
    assert c["gradients"] == 4 * shard  # fp32 grads
    assert c["optimizer_states"] == 12 * shard  # fp32 master + m + v, dp = 1
    c = train(est("Qwen2.5-32B", gpus=16, nodes=2, backend="megatron", tp=8, sequence_parallel=True))
    assert c["optimizer_states"] == math.ceil(12 * shard / 2)  # dp = 2 shards the optimizer


def test_expert_parallel_splits_only_the_experts():
    spec = resolve_model("Qwen3-30B-A3B")
    experts = 48 * 128 * 3 * 2048 * 768  # layers x experts x (gate, up, down) x hidden x expert width
    assert expert_params(spec) == experts
    dense = count_params(spec) - experts
    c = train(est("Qwen3-30B-A3B", gpus=8, backend="megatron", tp=1, ep=8))
    assert c["weights"] == 2 * (dense + experts // 8)
    # dense states shard over dp = 8, experts over the expert-data-parallel group 8 / 8 = 1
    assert c["optimizer_states"] == math.ceil(12 * dense / 8) + 12 * experts // 8


def test_pipeline_split():
    assert pipeline_split(28, 4) == [7, 7, 7, 7]
    assert pipeline_split(80, 3) == [27, 27, 26]  # the last stage is lighter
    assert pipeline_split(61, 16) == [4] * 15 + [1]  # DeepSeek-V3
    assert pipeline_split(28, 8) is None  # 8 stages cannot hold 28 layers evenly
    assert pipeline_split(28, 29) is None


def test_first_pipeline_stage_holds_embedding_and_pp_micro_batches():
    # without checkpointing stage 0 (embedding, 7 layers, 4 micro batches in flight) outweighs the
    # last stage (7 layers, the output head and the logits, 1 micro batch)
    e = est(gpus=8, backend="megatron", tp=2, pp=4, method="sft", max_len=1024, activation_checkpointing=False)
    c = train(e)
    assert e.phases["training"].note.startswith("pipeline stage 0")
    assert c["weights"] == 2 * math.ceil((7 * LAYER7 + V * H) / 2)  # 7 layers + embedding, over tp 2
    outside, inside = 4 * H, 2 * 28 * 128 + 2 * 4 * 128 + 4 * F
    assert c["activations"] == 4 * 7 * 2 * 1024 * (outside + inside // 2)  # 1F1B: pp = 4 micro batches
    assert c["logits"] == 0


# ---------------------------------------------------------------------------------------------
# Activations, logits, buffers


def test_activations_without_checkpointing_by_hand():
    tokens = 1536  # prompt 512 + response 1024, micro batch 1
    outside = 2 * H + 2 * H  # two norm inputs, attention and MLP inputs
    inside = 2 * (28 * 128) + 2 * (4 * 128) + 4 * F  # Q, attention output, K, V; gate, up, act, product
    c = train(est(gpus=8, activation_checkpointing=False))
    assert c["activations"] == L * 2 * tokens * (outside + inside) == 8_455_716_864


def test_activations_with_checkpointing_by_hand():
    tokens = 1536
    full_layer = 2 * tokens * (4 * H + 2 * 3584 + 2 * 512 + 4 * F)
    c = train(est(gpus=8, activation_checkpointing=True))
    assert c["activations"] == L * 2 * tokens * H + full_layer


def test_tensor_and_sequence_parallel_activations():
    tokens, outside, inside = 1536, 4 * H, 2 * 3584 + 2 * 512 + 4 * F
    no_sp = train(est(gpus=8, backend="megatron", tp=4, activation_checkpointing=False))
    sp = train(est(gpus=8, backend="megatron", tp=4, sequence_parallel=True, activation_checkpointing=False))
    assert no_sp["activations"] == L * 2 * tokens * (outside + inside // 4)  # Korthikanti: 10 + 24/t
    assert sp["activations"] == L * 2 * tokens * ((outside + inside) // 4)  # (34 ...)/t


def test_logits_by_hand():
    # the unfused loss's backward: bf16 logits and their bf16 gradient, fp32 log-softmax and its fp32 gradient;
    # GRPO on FSDP at the 1024 response positions of a 512 + 1024 sequence (logits_to_keep)
    assert train(est(gpus=8))["logits"] == 1024 * V * (2 + 2 + 4 + 4)
    assert train(est(gpus=8, method="sft", max_len=4096, micro_batch=2))["logits"] == 2 * 4096 * V * 12
    # Megatron's output layer runs on every position; vocabulary parallel: the engine's loss reads its 1/tp of the
    # vocabulary, never gathered, in row chunks (rlctl.algos.vocab_parallel: the logits and their gradient, + 4 fp32
    # chunks of 2**25 values: tests/algos/test_vocab_parallel*.py, tests/recipes/test_distill.py)
    megatron = est(gpus=8, backend="megatron", tp=4)
    assert train(megatron)["logits"] == 1536 * (V // 4) * (2 + 2) + 4 * 4 * 2**25
    assert any("at most 0.5 GiB" in line for line in megatron.assumptions)
    assert any("1/4 of the vocabulary, never gathered" in line for line in megatron.assumptions)
    assert not any("never gathered for the loss" in line for line in est(gpus=8).assumptions)  # FSDP: whole


def test_fsdp_unsharded_buffers_by_hand():
    head = V * H
    full = train(est(gpus=8))["unsharded_buffers"]
    assert full == 2 * (2 * LAYER7 + head) + 2 * (LAYER7 + head)  # gathered params + unsharded grads, bf16
    lora = train(est(gpus=8, lora_rank=16))["unsharded_buffers"]
    assert lora == 2 * (2 * LAYER7 + head)  # a frozen base has no gradients


# ---------------------------------------------------------------------------------------------
# Rollout engine and KV cache


def test_kv_bytes_per_token_by_hand():
    spec = qwen7()
    assert kv_bytes_per_token(spec, 1) == 2 * 28 * 4 * 128 * 2 == 57_344  # K and V, layers, kv heads, head dim, bf16
    assert kv_bytes_per_token(spec, 2) == 2 * 28 * 2 * 128 * 2
    assert kv_bytes_per_token(spec, 8) == 2 * 28 * 1 * 128 * 2  # 4 KV heads over 8 ranks: replicated
    assert kv_bytes_per_token(resolve_model("DeepSeek-V3"), 8) == 61 * (512 + 64) * 2  # MLA latent + rope key


def test_kv_bytes_per_token_equal_a_real_hf_cache():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlctl.catalog.hf_config import spec_from_hf_config

    config = AutoConfig.for_model("qwen2", **TINY["qwen2"])
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    with torch.no_grad():
        cache = model(input_ids=torch.arange(10)[None], use_cache=True).past_key_values
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    per_token = sum(t.numel() * t.element_size() for t in tensors) // 10
    assert per_token == kv_bytes_per_token(spec_from_hf_config(config.to_dict(), source="t", name="t"), 1)


def test_vllm_kv_cache_by_hand():
    gpu = GpuSpec("H100-80GB", 81089 * 2**20, 989.0, "NVLink", 900.0, 8)
    e = estimate_memory(qwen7(), gpu, MemorySettings(gpus=8, rollout="vllm", rollout_tp=1, mem_fraction=0.5))
    weights = 2 * P7
    # one engine step of 16384 tokens + sampler logits of 1024 sequences: vLLM 0.32's limits on an 80 GB H100
    act = 16384 * (2 * H + (28 + 2 * 4) * 128 + 3 * F) * 2 + 1024 * V * 4
    assert engine_activation_bytes(qwen7(), 16384, 1024, 1, 2) == act
    kv = int(0.5 * 81089 * 2**20) - weights - act  # gpu_memory_utilization covers weights, activations, cache
    r = rollout(e)
    assert (r["engine_weights"], r["engine_activations"], r["kv_cache"]) == (weights, act, kv)
    assert e.kv_cache_tokens == kv // 57_344
    assert e.kv_cache_sequences == kv // 57_344 // (512 + 1024)
    assert r["cuda_graphs"] == ENGINE_GRAPH_BYTES and r["cuda_context"] == CUDA_CONTEXT_BYTES


def test_sglang_fraction_leaves_activations_outside():
    gpu = GpuSpec("g", 80 * 2**30, 0.0, "NVLink", 0.0, 8)
    e = estimate_memory(qwen7(), gpu, MemorySettings(gpus=8, rollout="sglang", rollout_tp=2, mem_fraction=0.6))
    assert rollout(e)["kv_cache"] == int(0.6 * 80 * 2**30) - math.ceil(2 * P7 / 2)


def test_hf_engine_sizes_its_cache_for_the_batch():
    e = est(gpus=4, rollout="hf", rollout_batch=8, rollout_n=4, prompt_len=100, response_len=300)
    sequences = 8 * 4 // 4  # the batch's samples over 4 engines
    assert rollout(e)["kv_cache"] == sequences * 400 * 57_344
    assert e.kv_cache_sequences == sequences


def test_engine_without_room_for_a_kv_cache_does_not_fit():
    gpu = GpuSpec("small", 20 * 2**30, 0.0, "PCIe", 0.0, 8)
    e = estimate_memory(qwen7(), gpu, MemorySettings(gpus=8, rollout="vllm", mem_fraction=0.3))
    assert e.kv_cache_sequences == 0 and not e.fits
    assert "no room" in e.verdict


# ---------------------------------------------------------------------------------------------
# LoRA


def test_lora_adapter_count_by_hand():
    per_layer = 8 * ((H + H) + 2 * (H + 512) + (H + H) + 3 * (H + F))  # r x (in + out): q, k, v, o, gate, up, down
    assert lora_params(qwen7(), 8) == 28 * per_layer == 20_185_088  # peft prints the same for Qwen2.5-7B
    assert lora_params(qwen7(), 8, "q_proj,v_proj") == 28 * 8 * ((H + H) + (H + 512))


@pytest.mark.parametrize("arch", list(TINY))
@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_lora_count_equals_peft(arch, targets):
    from peft import LoraConfig, get_peft_model

    model, spec = _hf_meta(arch, **TINY[arch])
    if arch == "deepseek_v3" and targets != "all-linear":
        targets = "q_a_proj,kv_b_proj"  # MLA has no q_proj/v_proj
    tm = targets if targets == "all-linear" else targets.split(",")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=tm))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert lora_params(spec, 4, targets) == trainable


def test_lora_states_are_the_adapters_and_the_frozen_base():
    a = lora_params(qwen7(), 32)
    c = train(est(gpus=1, lora_rank=32))
    assert c["weights"] == 2 * P7 + 4 * a  # bf16 frozen base + fp32 adapters
    assert c["gradients"] == 4 * a and c["optimizer_states"] == 8 * a
    assert c["reference_model"] == 0  # the reference is the base with adapters disabled


# ---------------------------------------------------------------------------------------------
# Phases, offload, critic, output


def test_rollout_phase_keeps_trainer_states_unless_offloaded():
    on = est(gpus=8, rollout="sglang", mem_fraction=0.5)
    assert rollout(on)["trainer_weights"] == P7 * 4 // 8
    assert rollout(on)["trainer_optimizer"] == P7
    assert rollout(on)["trainer_gradients"] == 0  # FSDP frees gradients after the step
    assert rollout(on)["reference_model"] == 2 * P7 // 8


def test_fsdp_cpu_offload_moves_every_sharded_state_to_cpu():
    for flags in (dict(offload_params=True), dict(offload_optimizer=True)):  # CPUOffloadPolicy moves all three
        off = est(gpus=8, rollout="sglang", mem_fraction=0.5, **flags)
        for phase in (train(off), rollout(off)):
            assert all(
                phase.get(k, 0) == 0
                for k in (
                    "weights",
                    "gradients",
                    "optimizer_states",
                    "trainer_weights",
                    "trainer_optimizer",
                    "reference_model",
                )
            )
        assert (
            train(off)["unsharded_buffers"] == train(est(gpus=8))["unsharded_buffers"]
        )  # gathered layers still on GPU
    sft = est(gpus=1, method="sft", offload_params=True)
    assert train(sft)["weights"] == train(sft)["optimizer_states"] == 0  # it shrinks the update too
    cpu = est(gpus=1, method="sft", device="cpu", dtype="fp32", offload_params=True)
    assert train(cpu)["weights"] == 4 * P7  # nothing to offload to on a CPU run


def test_megatron_offloads_weights_between_phases_and_the_optimizer_for_good():
    on = est(gpus=8, backend="megatron", tp=8)
    assert rollout(on)["trainer_gradients"] == 4 * math.ceil(P7 / 8)  # Megatron keeps its grad buffer
    weights = est(gpus=8, backend="megatron", tp=8, offload_params=True)
    assert rollout(weights)["trainer_weights"] == rollout(weights)["trainer_gradients"] == 0
    assert train(weights)["weights"] == train(on)["weights"] > 0  # back on the GPU for the update
    assert train(weights)["reference_model"] == 0 and train(on)["reference_model"] == 2 * math.ceil(P7 / 8)
    # optimizer_cpu_offload: master weights and AdamW states live on the CPU for the whole run
    both = est(gpus=8, backend="megatron", tp=8, offload_params=True, offload_optimizer=True)
    assert train(both)["optimizer_states"] == rollout(both)["trainer_optimizer"] == 0 < train(on)["optimizer_states"]
    assert train(both)["gradients"] == train(on)["gradients"] == 4 * math.ceil(P7 / 8)  # the GPU gradient buffer stays
    sft = est(gpus=8, method="sft", backend="megatron", tp=8, offload_optimizer=True)
    assert train(sft)["optimizer_states"] == 0  # it shrinks an SFT update too


# ---------------------------------------------------------------------------------------------
# Host memory

H100 = GpuSpec("H100-80GB", 81089 * 2**20, 989.0, "NVLink", 900.0, 8, host_memory_bytes=2048 * 2**30)
GIB = 2**30


def host(e, phase="training"):
    return e.host_phases[phase].components


def test_fsdp_offload_host_memory_by_hand():
    """Qwen2.5-7B, FSDP2 CPU offload over 8 GPUs: each parameter's fp32 shard is pinned, and torch's
    pinned allocator rounds every allocation up to a power of two."""
    q_o = 2**23  # 3584/8 rows x 3584 x 4 B = 6,422,528 -> 8 MiB
    k_v = 2**20  # 512/8 x 3584 x 4 = 917,504 -> 1 MiB
    biases = 2048 + 2 * 256  # q: 448 x 4 = 1792 -> 2048; k, v: 64 x 4 = 256
    mlp = 2**26  # gate, up: 18944/8 x 3584 x 4 = 33,947,648 -> 64 MiB; down: 3584/8 x 18944 x 4, the same
    norms = 4096  # 7168 / 8 x 4 = 3584 -> 4096
    vocab = 2**29  # embedding and head: 152064/8 x 3584 x 4 = 272,498,688 -> 512 MiB
    pinned = L * (2 * q_o + 2 * k_v + biases + 3 * mlp + norms) + 2 * vocab + 2048  # + the final norm
    assert pinned == 7_239_557_120  # 1.9 x the 3,807,808,256 bytes of an unpinned fp32 shard
    e = estimate_memory(qwen7(), H100, MemorySettings(method="sft", gpus=8, offload_params=True))
    t = host(e)
    assert (t["offloaded_weights"], t["offloaded_gradients"]) == (8 * pinned, 8 * pinned)
    assert t["offloaded_optimizer"] == 8 * P7  # AdamW m, v: 8 bytes per parameter over 8 GPUs, pageable, on 8 GPUs
    assert t["processes"] == 8 * 4 * GIB
    assert e.host_bytes == 8 * (2 * pinned + P7 + 4 * GIB)
    loading = host(e, "loading")  # rank 0 reads the bf16 checkpoint beside the shards
    assert loading["checkpoint"] == 2 * P7 and loading["offloaded_weights"] == 8 * pinned
    assert e.host_memory_bytes == 2048 * GIB and e.host_fits and e.fits
    assert e.host_limit_bytes == int(0.9 * 2048 * GIB)


def test_megatron_optimizer_offload_host_memory_by_hand():
    """Megatron tp 4 x dp 2, optimizer_cpu_offload: pinned fp32 master and gradient copies of each rank's
    pieces (tp-split, then halved by the distributed optimizer), pageable AdamW states."""
    pieces = (
        2 * 2**23 + 2 * 2**20 + 2048 + 256 * 2 + 3 * 2**26 + 16384
    )  # as FSDP/8, but norms are replicated: 3584 x 4 -> 16 KiB
    pinned = L * pieces + 2 * 2**29 + 8192  # embedding, head (vocabulary parallel), final norm 1792 x 4 -> 8 KiB
    e = est(method="sft", gpus=8, backend="megatron", tp=4, offload_optimizer=True, gpu=H100)
    t = host(e)
    assert t["offloaded_gradients"] == 8 * pinned
    assert t["offloaded_optimizer"] == 8 * (pinned + 8 * (P7 // 4 // 2))  # master + m, v of P / (tp dp) parameters
    assert train(e)["optimizer_states"] == 0


def test_host_memory_per_node_is_a_share_of_the_gpu_types_node():
    assert est(gpu=H100, gpus=1, method="sft").host_memory_bytes == 256 * GIB  # one of 8 GPUs: 2 TiB / 8
    assert est(gpu=H100, gpus=16, nodes=2, method="sft").host_memory_bytes == 2048 * GIB
    assert est(gpu=H100, gpus=1, method="sft", host_memory_bytes=100 * GIB).host_memory_bytes == 100 * GIB
    unknown = est(gpus=1, method="sft")  # a GPU type without host memory: not checked
    assert unknown.host_memory_bytes == 0 and unknown.host_fits
    assert (
        est(gpus=1, method="sft", device="cpu", dtype="fp32").host_phases == {}
    )  # CPU runs: the GPU budget is the host


def test_a_sleeping_engine_keeps_no_weights_in_host_memory():
    """vLLM sleeps at level 2 (rlctl.rollout.vllm) and SGLang releases its weights: neither leaves a host copy."""
    for engine in ("vllm", "sglang"):
        e = est(gpu=H100, gpus=8, rollout=engine, rollout_tp=2, mem_fraction=0.5)
        assert "engine_weights" not in host(e) and "engine_weights" not in host(e, "rollout")


def test_72b_full_sft_on_one_a10g_does_not_fit_its_host():
    from rlctl.catalog import resolve_gpu

    p72 = count_params(resolve_model("Qwen2.5-72B"))
    e = estimate_memory(
        resolve_model("Qwen2.5-72B"), resolve_gpu("A10G"), MemorySettings(method="sft", gpus=1, offload_params=True)
    )
    assert e.headroom_bytes > 0  # the GPU holds the gathered layers and activations
    assert e.host_memory_bytes == 192 * GIB // 4  # a g5.12xlarge's share
    assert e.host_bytes > 16 * p72 > e.host_memory_bytes  # 16 bytes per parameter, 1.2 TB
    assert not e.host_fits and not e.fits and "host memory" in e.verdict


def test_ppo_has_an_idle_critic_and_a_reference():
    ppo = train(est(gpus=8, method="ppo", rollout="vllm"))
    critic = P7 - V * H + H + 1  # the body with a scalar value head
    assert ppo["critic"] == math.ceil(critic / P7 * (P7 * 4 // 8 + P7))  # weights + optimizer, sharded
    assert ppo["reference_model"] == 2 * P7 // 8
    assert train(est(gpus=8, method="grpo", kl=False))["reference_model"] == 0


def test_sft_has_only_a_training_phase():
    e = est(gpus=8, method="sft")
    assert list(e.phases) == ["training"]
    assert e.peak_phase == "training" and e.peak_bytes == e.phases["training"].total_bytes


def test_fits_headroom_and_json():
    gpu = GpuSpec("H100-80GB", 81089 * 2**20, 989.0, "NVLink", 900.0, 8)
    e = estimate_memory(qwen7(), gpu, MemorySettings(gpus=8, rollout="sglang", mem_fraction=0.5))
    d = json.loads(json.dumps(e.to_dict()))
    for key in (
        "model",
        "params",
        "gpu",
        "gpu_memory_bytes",
        "phases",
        "peak_bytes",
        "fits",
        "kv_cache_tokens",
        "kv_cache_sequences",
        "headroom_bytes",
        "assumptions",
        "verdict",
        "host_bytes",
        "host_memory_bytes",
        "host_phases",
        "host_fits",
    ):
        assert key in d
    assert d["params"] == P7 and d["model"] == "Qwen2.5-7B"
    assert d["peak_bytes"] == max(p["total_bytes"] for p in d["phases"].values())
    cached_out = {"cuda_context", "engine_weights", "kv_cache", "engine_activations", "cuda_graphs"}
    transient = {"activations", "logits", "unsharded_buffers"}
    for phase in d["phases"].values():
        parts = phase["components"]
        allocated = sum(v for k, v in parts.items() if k not in cached_out)
        assert phase["allocated_bytes"] == allocated  # what max_memory_allocated would say
        # reserved: the allocator's cache grows by a quarter of the tensors freed every micro batch
        slack = sum(v for k, v in parts.items() if k in transient) / 4
        assert abs(phase["reserved_bytes"] - allocated - slack) <= 1
        # the device: reserved plus what torch's allocator does not hold (the verdict's figure)
        assert phase["total_bytes"] == phase["reserved_bytes"] + sum(v for k, v in parts.items() if k in cached_out)
    assert d["headroom_bytes"] == d["gpu_memory_bytes"] - d["peak_bytes"]
    assert d["fits"] is True and d["verdict"].startswith("fits")
    small = estimate_memory(
        qwen7(), GpuSpec("g", 16 * 2**30, 0.0, "PCIe", 0.0, 8), MemorySettings(gpus=1, method="sft")
    )
    assert not small.fits and small.headroom_bytes < 0 and small.verdict.startswith("does not fit")


def test_fp32_on_cpu_has_no_cuda_context():
    e = est(gpus=2, device="cpu", dtype="fp32", method="sft", max_len=64)
    assert train(e)["cuda_context"] == 0
    assert train(e)["weights"] == P7 * 4 // 2


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(method="kto"), "method"),
        (dict(gpus=2, backend="fsdp", tp=2), "fsdp"),
        (dict(gpus=6, backend="megatron", tp=4), "do not split"),
        (dict(gpus=8, backend="megatron", pp=8), r"parallel.pp=8 cannot split the 28 layers of .*; valid pp: 1, 2"),
        (dict(gpus=8, backend="megatron", ep=2), r"parallel.ep=2: .* is dense; expert parallelism needs a MoE"),
        (dict(gpus=8, rollout_tp=3), "rollout tp"),
    ],
)
def test_impossible_settings_are_user_errors(kw, words):
    with pytest.raises(UserError, match=words):
        est(**kw)


def test_estimator_and_planner_import_no_torch():
    code = (
        "import sys, rlctl.estimate, rlctl.plan, rlctl.cli.estimate; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------
# `rlctl estimate memory`


def _cli(*args):
    from typer.testing import CliRunner

    from rlctl.cli.estimate import app

    return CliRunner().invoke(app, ["memory", *args])


def test_cli_json_gives_a_full_answer():
    r = _cli("--model", "Qwen2.5-7B", "--method", "grpo", "--gpus", "8", "--gpu", "H100-80GB", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert (d["model"], d["params"], d["gpu"], d["gpu_memory_bytes"]) == ("Qwen2.5-7B", P7, "H100-80GB", 81089 * 2**20)
    assert set(d["phases"]) == {"training", "rollout"} and d["fits"] is True
    assert d["kv_cache_sequences"] >= 1 and d["kv_cache_tokens"] == d["kv_cache_bytes"] // 57_344
    assert d["plan"]["backend"] == "fsdp" and d["plan"]["rollout"] == "sglang" and d["plan"]["gpus"] == 8
    assert d["settings"]["micro_batch"] == d["plan"]["micro_batch_size"]
    assert "what_to_rent" not in d


def test_cli_options_reach_the_estimate():
    r = _cli(
        "--model",
        "Qwen2.5-7B",
        "--gpus",
        "8",
        "--max-prompt-len",
        "1024",
        "--max-response-len",
        "3072",
        "--n",
        "4",
        "--rollout",
        "vllm",
        "--rollout-tp",
        "2",
        "--mem-fraction",
        "0.5",
        "--micro-batch-size",
        "1",
        "--no-activation-checkpointing",
        "--offload-optimizer",
        "--json",
    )
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)["settings"]
    assert (s["prompt_len"], s["response_len"], s["rollout_n"], s["rollout"], s["rollout_tp"]) == (
        1024,
        3072,
        4,
        "vllm",
        2,
    )
    assert (s["mem_fraction"], s["micro_batch"], s["activation_checkpointing"], s["offload_optimizer"]) == (
        0.5,
        1,
        False,
        True,
    )


def test_cli_takes_the_training_commands_names_and_the_old_ones_hidden():
    # the names `rlctl grpo` uses; the old ones still work but are not in --help
    new = _cli(
        "--model",
        "Qwen2.5-7B",
        "--gpus",
        "8",
        "--max-prompt-len",
        "300",
        "--max-response-len",
        "700",
        "--micro-batch-size",
        "2",
        "--json",
    )
    old = _cli(
        "--model",
        "Qwen2.5-7B",
        "--gpus",
        "8",
        "--prompt-len",
        "300",
        "--response-len",
        "700",
        "--micro-batch",
        "2",
        "--json",
    )
    assert new.exit_code == 0 and old.exit_code == 0, (new.output, old.output)
    s = json.loads(new.output)["settings"]
    assert (s["prompt_len"], s["response_len"], s["micro_batch"]) == (300, 700, 2)
    assert json.loads(old.output) == json.loads(new.output)
    both = _cli("--model", "Qwen2.5-7B", "--gpus", "8", "--max-prompt-len", "300", "--prompt-len", "300", "--json")
    assert both.exit_code == 0 and json.loads(both.output)["settings"]["prompt_len"] == 300
    clash = _cli("--model", "Qwen2.5-7B", "--gpus", "8", "--micro-batch-size", "2", "--micro-batch", "4")
    assert isinstance(clash.exception, UserError)
    assert str(clash.exception).count("\n") == 0 and "--micro-batch-size 2" in str(clash.exception)
    import re

    help_text = re.sub(r"\x1b\[[0-9;]*m", "", _cli("--help-all").output)
    assert "--max-prompt-len" in help_text and "--micro-batch-size" in help_text
    assert not re.search(r"--prompt-len\b|--response-len\b|--micro-batch\b(?!-)", help_text)


@pytest.mark.parametrize("gpus", ["0", "-2"])
def test_cli_gpus_below_one_is_a_one_line_error(gpus):
    # it used to plan a full node of 8 GPUs without a word
    r = _cli("--model", "Qwen2.5-7B", "--gpus", gpus, "--json")
    assert isinstance(r.exception, UserError), r.output
    msg = str(r.exception)
    assert "\n" not in msg and msg.startswith(f"--gpus {gpus}:") and "--device cpu" in msg
    r = subprocess.run(
        [sys.executable, "-m", "rlctl", "estimate", "memory", "--model", "Qwen2.5-7B", "--gpus", gpus],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_cli_what_to_rent_rows():
    r = _cli("--model", "Qwen2.5-32B", "--method", "sft", "--what-to-rent", "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["what_to_rent"]
    from rlctl.catalog import list_gpus

    # per GPU type: the fewest GPUs without offload, then with offload allowed
    assert [(row["gpu"], row["offload"]) for row in rows] == [(g.name, o) for g in list_gpus() for o in (False, True)]
    for none, allowed in zip(rows[::2], rows[1::2]):
        for row in (none, allowed):
            assert set(row) >= {"gpu", "gpus", "nodes", "offload", "fits"}
            if row["fits"]:
                assert row["peak_bytes"] <= row["gpu_memory_bytes"] and row["host_bytes"] <= row["host_memory_bytes"]
                assert {"backend", "tp", "pp", "dp", "offload_params", "offload_optimizer"} <= set(row["plan"])
        if none["fits"]:
            assert not none["plan"]["offload_params"] and not none["plan"]["offload_optimizer"]
            assert allowed["fits"] and allowed["gpus"] <= none["gpus"]
    h100 = rows[1]  # H100-80GB, offload allowed
    assert h100["fits"] and h100["gpus"] < rows[0]["gpus"] and h100["plan"]["offload_optimizer"]
    # the row is the plan `rlctl estimate memory` gives at that count
    at = json.loads(
        _cli(
            "--model",
            "Qwen2.5-32B",
            "--method",
            "sft",
            "--gpus",
            str(h100["gpus"]),
            "--nodes",
            str(h100["nodes"]),
            "--gpu",
            "H100-80GB",
            "--json",
        ).output
    )
    assert at["fits"] and {k: at["plan"][k] for k in h100["plan"] if k in at["plan"]} == h100["plan"]
    assert at["peak_bytes"] == h100["peak_bytes"] and at["host_bytes"] == h100["host_bytes"]


def test_cli_text_output():
    r = _cli("--model", "Qwen2.5-72B", "--method", "sft", "--gpus", "8", "--gpu", "H100-80GB", "--what-to-rent")
    assert r.exit_code == 0, r.output
    for words in (
        "plan: rlctl sft Qwen2.5-72B",
        "training (GiB)",
        "host memory per node",
        "rejected megatron",
        "what to rent",
        "+ offload",
        "B200",
    ):
        assert words in r.output
    r = _cli("--model", "Qwen2.5-72B", "--method", "sft", "--gpus", "1", "--gpu", "A10G")
    for words in ("does not fit", "host memory", "what would fit", "x A10G"):
        assert words in r.output


def test_cli_host_memory_option():
    def run(*extra):
        r = _cli("--model", "Qwen2.5-7B", "--method", "sft", "--gpus", "1", "--gpu", "H100-80GB", "--json", *extra)
        assert r.exit_code == 0, r.output
        return json.loads(r.output)

    typical = run()
    assert typical["host_memory_bytes"] == 256 * GIB and typical["fits"]  # a p5.4xlarge: 2 TiB / 8
    assert typical["plan"]["offload_optimizer"] and 100 * GIB < typical["host_bytes"] < 0.9 * 200 * GIB
    small = run("--host-memory", "100")
    assert small["host_memory_bytes"] == 100 * GIB and not small["fits"] and not small["plan"]["fits"]
    assert any(r.startswith("rejected fsdp with CPU offload") and "host memory" in r for r in small["plan"]["reasons"])
    assert "--host-memory" in small["plan"]["reasons"][-1]  # what would fit: more host memory
    assert run("--host-memory", "200")["fits"]
    assert isinstance(_cli("--model", "Qwen2.5-7B", "--host-memory", "0").exception, UserError)


def test_cli_unknown_model_is_one_line_exit_2():
    r = subprocess.run(
        [sys.executable, "-m", "rlctl", "estimate", "memory", "--model", "Qwen9-7B"], capture_output=True, text=True
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: unknown model 'Qwen9-7B'")
    assert "Traceback" not in r.stderr
    assert isinstance(_cli("--model", "Qwen9-7B").exception, UserError)


def test_kv_bytes_per_token_agree_with_the_catalog():
    from rlctl.catalog import kv_cache_bytes_per_token

    for spec in list_models():
        assert kv_bytes_per_token(spec, 1) == kv_cache_bytes_per_token(spec)


def test_a_rollout_split_counts_trainer_and_rollout_devices_apart():
    """rollout_procs (docs/offpolicy.md): the trainer devices hold what 6 colocated GPUs hold while
    training (vLLM sleeps then), the rollout devices the engine alone, its KV cache for its half of the batch."""
    from rlctl.estimate.rollout import kv_bytes_per_token

    kw = dict(method="grpo", rollout="hf", rollout_batch=16, rollout_n=4, prompt_len=256, response_len=512)
    split = est(gpus=6, rollout_procs=2, **kw)
    colocated = est(gpus=6, **{**kw, "rollout": "vllm"})  # vLLM sleeps through the update: nothing awake
    assert split.phases["training"].components == colocated.phases["training"].components
    rollout = split.phases["rollout"].components
    assert set(rollout) == {"engine_weights", "kv_cache", "engine_activations", "cuda_context"}
    assert rollout["engine_weights"] == 2 * P7
    assert rollout["kv_cache"] == (16 * 4 // 2) * (256 + 512) * kv_bytes_per_token(qwen7(), 1, 2)
    assert "rollout devices (2)" in split.phases["rollout"].note
    assert any("rollout-only devices" in line for line in split.assumptions)


def test_vocab_parallel_chunk_is_the_engines():
    """The estimator's torch-free copy of the vocab-parallel loss's chunk size is the one the loss uses."""
    from rlctl.algos.vocab_parallel import CHUNK_ELEMENTS
    from rlctl.estimate.settings import VOCAB_PARALLEL_CHUNK_VALUES

    assert VOCAB_PARALLEL_CHUNK_VALUES == CHUNK_ELEMENTS
