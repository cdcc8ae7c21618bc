"""The planner's search over the memory savers: the plain module on one GPU, activation offload
before offloading the states, each with its reason, and apply_plan writing them into the config."""

from __future__ import annotations

from rlctl.config import build_config, dotted_to_nested
from rlctl.plan import apply_plan
from rlctl.plan.inputs import LocalEnv
from rlctl.plan.planner import plan_config
from rlctl.presets import method_layers


def plan(method="sft", **sets):
    layer = dotted_to_nested({"hardware.device": "cuda", **{k.replace("__", "."): v for k, v in sets.items()}})
    cfg = build_config(method, method_layers(method, None) + [layer])
    return cfg, plan_config(cfg, LocalEnv())


def test_one_gpu_runs_the_plain_module_with_its_reason():
    cfg, p = plan(model__name="Qwen2.5-0.5B", hardware__gpus=1, hardware__gpu="H100")
    s = p.estimate.settings
    assert p.fits and not s.shard
    assert p.estimate.phases["training"].components["unsharded_buffers"] == 0
    assert any(r.startswith("shard off: one GPU") for r in p.reasons)
    assert apply_plan(cfg, p).parallel.shard is False


def test_several_gpus_stay_sharded_and_a_user_choice_is_kept():
    cfg, p = plan(model__name="Qwen2.5-0.5B", hardware__gpus=8, hardware__gpu="H100")
    assert p.estimate.settings.shard and apply_plan(cfg, p).parallel.shard is True
    cfg, p = plan(model__name="Qwen2.5-0.5B", hardware__gpus=1, hardware__gpu="H100", parallel__shard="true")
    assert p.estimate.settings.shard and not any(r.startswith("shard off") for r in p.reasons)


def test_activation_offload_comes_before_offloading_the_states():
    """Llama-3.1-8B LoRA at 3072 tokens on a 24 GB card: full checkpointing alone leaves it over the
    margin; activation offload fits without moving weights or optimizer states to the CPU."""
    cfg, p = plan(
        model__name="Llama-3.1-8B",
        hardware__gpus=1,
        hardware__gpu="RTX-4090",
        lora__rank=8,
        train__max_len=3072,
        train__precision="bf16",
    )
    s = p.estimate.settings
    assert p.fits and s.offload_activations and not (s.offload_params or s.offload_optimizer)
    assert any("rejected fsdp, dp 1" in r for r in p.reasons)
    assert p.estimate.host_phases["training"].components["offloaded_activations"] > 0
    assert apply_plan(cfg, p).parallel.offload_activations is True


def test_one_cpu_process_runs_the_plain_module_and_two_stay_sharded():
    def cpu_plan(nproc: int):
        layer = dotted_to_nested({"hardware.device": "cpu", "hardware.nproc": nproc, "model.name": "Qwen2.5-0.5B"})
        cfg = build_config("sft", method_layers("sft", None) + [layer])
        return cfg, plan_config(cfg, LocalEnv(memory_bytes=64 * 2**30))

    cfg, p = cpu_plan(1)
    assert not p.estimate.settings.shard and apply_plan(cfg, p).parallel.shard is False
    assert any(r.startswith("shard off: one process") for r in p.reasons)
    cfg, p = cpu_plan(2)
    assert p.estimate.settings.shard and apply_plan(cfg, p).parallel.shard is True


def test_a_resolved_config_decides_every_on_off_setting():
    """None (the plan decides) is never left after apply_plan, for every method, backend and device; a
    value the user gave is kept."""
    import dataclasses

    cases = [
        ("sft", {"model.name": "Qwen2.5-0.5B", "hardware.gpus": 1, "hardware.gpu": "H100"}),
        (
            "grpo",
            {
                "model.name": "Qwen2.5-7B",
                "hardware.gpus": 8,
                "hardware.gpu": "H100",
                "parallel.offload_optimizer": False,
            },
        ),
        ("ppo", {"model.name": "Qwen2.5-72B", "hardware.gpus": 16, "hardware.gpu": "H100"}),
        ("sft", {"model.name": "Qwen2.5-0.5B", "hardware.device": "cpu", "parallel.offload_params": "false"}),
    ]
    for method, sets in cases:
        cfg = build_config(method, method_layers(method, None) + [dotted_to_nested(sets)])
        resolved = apply_plan(cfg, plan_config(cfg, LocalEnv(memory_bytes=64 * 2**30)))
        flags = {f.name: getattr(resolved.parallel, f.name) for f in dataclasses.fields(resolved.parallel)}
        on_off = {k: v for k, v in flags.items() if k not in ("backend", "tp", "pp", "cp", "ep", "sp")}
        assert flags["sp"] == 1  # None (the plan decides) resolved to a size
        assert len(on_off) == 7 and all(isinstance(v, bool) for v in on_off.values()), (method, sets, on_off)
        for key in (k for k in sets if k.startswith("parallel.")):
            assert on_off[key.split(".")[1]] is False  # the user's false ("false" read as False) is kept


def test_a_rollout_split_is_a_decision_with_its_reasons():
    cfg, p = plan("grpo", model__name="Qwen2.5-0.5B", hardware__gpus=8, hardware__gpu="H100", rollout__procs=2)
    (d,) = [d for d in p.decisions if d.key == "rollout.procs"]
    assert d.value == {"rollout": 2, "train": 6, "max_staleness": 1}
    assert "comparable" in d.why and "long-tailed" in d.why and "does not" in d.why
    _, plain = plan("grpo", model__name="Qwen2.5-0.5B", hardware__gpus=8, hardware__gpu="H100")
    assert not [d for d in plain.decisions if d.key == "rollout.procs"]
