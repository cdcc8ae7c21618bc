"""rlctl's estimates and plans beside published figures, for docs/estimate.md.

It sits in rlctl.plan, above the estimator, because some tables are plans (the worked example,
verl's minimum GPUs). ``python -m rlctl.plan.compare`` prints the comparison tables; ``--write docs/estimate.md``
puts them between the file's ``<!-- compare:begin -->`` and ``<!-- compare:end -->`` markers. A
test checks the two agree, so every rlctl number in the docs is computed, never typed.
"""

from __future__ import annotations

from rlctl.catalog import (
    count_params,
    layer_params,
    list_gpus,
    resolve_gpu,
    resolve_model,
)
from rlctl.catalog.spec import GpuSpec
from rlctl.estimate import MemorySettings, estimate_memory
from rlctl.estimate.memory import GIB
from rlctl.estimate.result import component_rows

UNBOUNDED = GpuSpec("unbounded", 10**15, 0.0, "NVLink", 0.0, 8)
GB = 10**9


def _states(est) -> int:
    c = est.phases["training"].components
    return c["weights"] + c["gradients"] + c["optimizer_states"]


def llama_factory() -> str:
    """LLaMA-Factory's README table (GB for the whole job, estimated): SFT, one process."""
    rows = [
        ("7B", "Qwen2.5-7B", 120, 16),
        ("14B", "Qwen2.5-14B", 240, 32),
        ("30B", "Qwen2.5-32B", 600, 64),
        ("70B", "Llama-3.1-70B", 1200, 160),
    ]
    out = [
        "| size | rlctl model | LLaMA-Factory full (AMP) | rlctl full: states / peak | LLaMA-Factory LoRA "
        "| rlctl LoRA r16: states / peak |",
        "|---|---|---|---|---|---|",
    ]
    for size, name, full_gb, lora_gb in rows:
        spec = resolve_model(name)
        cells = []
        for rank in (0, 16):
            e = estimate_memory(spec, UNBOUNDED, MemorySettings(method="sft", gpus=1, max_len=1024, lora_rank=rank))
            cells.append(f"{_states(e) / GB:.0f} / {e.peak_bytes / GB:.0f} GB")
        out.append(f"| {size} | {name} | {full_gb} GB | {cells[0]} | {lora_gb} GB | {cells[1]} |")
    return "\n".join(out)


def torchtune() -> str:
    """torchtune's README (peak GiB per GPU, batch 2, sequence 2048, activation checkpointing)."""
    cases = [
        ("Llama-3.1-8B LoRA, 1 x RTX 4090", "Llama-3.1-8B", 1, 16, "16.2 GiB"),
        ("Llama-3.1-70B LoRA, 8 x A100", "Llama-3.1-70B", 8, 16, "27.6 GiB"),
        ("Llama-3.1-8B full, 1 x RTX 4090", "Llama-3.1-8B", 1, 0, "18.9 GiB"),
        ("Llama-3.1-70B full, 8 x A100 (CPU offload)", "Llama-3.1-70B", 8, 0, "13.9 GiB"),
    ]
    out = ["| recipe | torchtune | rlctl peak | rlctl peak with FSDP2 CPU offload |", "|---|---|---|---|"]
    for label, name, gpus, rank, theirs in cases:
        cells = []
        for offload in (False, True):
            s = MemorySettings(
                method="sft",
                gpus=gpus,
                max_len=2048,
                micro_batch=2,
                lora_rank=rank,
                offload_params=offload,
                lora_targets="q_proj,v_proj,o_proj" if rank else "all-linear",
            )
            cells.append(f"{estimate_memory(resolve_model(name), UNBOUNDED, s).peak_bytes / GIB:.1f} GiB")
        out.append(f"| {label} | {theirs} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)


def deepspeed_zero3() -> str:
    """DeepSpeed's ZeRO-3 model-state estimate (4 x largest layer + 18 x P / N bytes) beside rlctl's
    FSDP2 full shard (16 x P / N + the unsharded layers and head)."""
    out = ["| model | GPUs | DeepSpeed ZeRO-3 | rlctl FSDP2 states + unsharded buffers |", "|---|---|---|---|"]
    for name, gpus in (("Qwen2.5-7B", 8), ("Qwen2.5-14B", 8), ("Llama-3.1-70B", 64)):
        spec = resolve_model(name)
        ds = 4 * layer_params(spec) + 18 * count_params(spec) // gpus
        e = estimate_memory(spec, UNBOUNDED, MemorySettings(method="sft", gpus=gpus))
        ours = _states(e) + e.phases["training"].components["unsharded_buffers"]
        out.append(f"| {name} | {gpus} | {ds / GIB:.1f} GiB | {ours / GIB:.1f} GiB |")
    return "\n".join(out)


def verl_min_gpus() -> str:
    """verl's "minimum GPUs found to work" for GRPO beside the fewest GPUs rlctl plans for, without
    offload and with offload allowed (host memory permitting)."""
    from rlctl.config import build_config
    from rlctl.plan.advice import smallest_fit
    from rlctl.plan.inputs import LocalEnv
    from rlctl.presets import method_layers

    local = LocalEnv(0, None, frozenset())
    cases = [
        ("Qwen2.5-7B LoRA", "Qwen2.5-7B", 32, "H100-80GB", "1 x H100"),
        ("Qwen2-7B full", "Qwen2.5-7B", 0, "H100-80GB", "2 x H800 (offload, rollout TP 2, fraction 0.6)"),
        ("Qwen2-14B full", "Qwen2.5-14B", 0, "H100-80GB", "4 x H800"),
        ("Qwen2.5-14B LoRA", "Qwen2.5-14B", 32, "H100-80GB", "2 x H100"),
        ("Qwen2-32B full", "Qwen2.5-32B", 0, "H20-96GB", "8 x H20 (Megatron)"),
        ("Qwen2.5-32B LoRA", "Qwen2.5-32B", 32, "H100-80GB", "4 x H100"),
        ("Qwen2-70B full", "Qwen2.5-72B", 0, "H100-80GB", "32 x H800 (rollout TP 16)"),
        ("Qwen2.5-72B LoRA", "Qwen2.5-72B", 32, "H100-80GB", "8 x H100"),
    ]
    out = [
        "| job (verl) | rlctl model | verl minimum | rlctl without offload | rlctl with offload allowed |",
        "|---|---|---|---|---|",
    ]
    for label, name, rank, gpu_name, theirs in cases:
        layers = method_layers("grpo", None) + [{"model": {"name": name}, "lora": {"rank": rank}}]
        cfg, gpu = build_config("grpo", layers), resolve_gpu(gpu_name)
        cells = []
        for offload in (False, True):
            row = smallest_fit(cfg, gpu, local, offload=offload)
            if row is None:
                cells.append("does not fit")
                continue
            p, est = row.plan, row.plan.estimate
            layout = f"fsdp dp{p.dp}" if p.backend == "fsdp" else f"megatron tp{p.tp} pp{p.pp} dp{p.dp}"
            moved = "+".join(k for k, on in (("params", p.offload_params), ("optimizer", p.offload_optimizer)) if on)
            host = f", host {est.host_bytes / GIB:.0f}/{est.host_memory_bytes / GIB:.0f} GiB" if moved else ""
            cells.append(
                f"{row.gpus} x {gpu_name}: {layout}, {p.rollout} tp{p.rollout_tp} @{p.rollout_mem_fraction:.2f}"
                + (f", offload {moved}" if moved else "")
                + host
            )
        out.append(f"| {label} | {name} | {theirs} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)


def _phase_table(phases: dict) -> list[str]:
    """A markdown table of components (rows) by phase (columns), in GiB."""
    names = list(phases)
    out = ["| component | " + " | ".join(f"{n} (GiB)" for n in names) + " |", "|---|" + "---|" * len(names)]
    for comp, cells in component_rows(phases):
        out.append(f"| {comp} | " + " | ".join(f"{v / GIB:.2f}" if v else "-" for v in cells) + " |")
    out.append("| **total** | " + " | ".join(f"**{phases[n].total_bytes / GIB:.2f}**" for n in names) + " |")
    return out


def example() -> str:
    """The plan, per-GPU and per-node host memory of
    `rlctl estimate memory --model Qwen2.5-7B --method grpo --gpus 8`."""
    from rlctl.config import build_config
    from rlctl.plan import LocalEnv, resolve_plan
    from rlctl.presets import method_layers

    layers = method_layers("grpo", None) + [
        {"model": {"name": "Qwen2.5-7B"}, "hardware": {"gpus": 8, "gpu": "H100-80GB"}}
    ]
    plan = resolve_plan(build_config("grpo", layers), local=LocalEnv())
    est = plan.estimate
    head = (
        f"Plan: {plan.backend} dp {plan.dp}, rollout {plan.rollout} tp {plan.rollout_tp} at memory fraction "
        f"{plan.rollout_mem_fraction:.2f}, micro batch {plan.micro_batch_size}, activation checkpointing "
        f"{'on' if plan.activation_checkpointing else 'off'}. KV cache: {est.kv_cache_tokens:,} tokens = "
        f"{est.kv_cache_sequences} sequences of {est.settings.seq_len} tokens. Verdict: {est.verdict}."
    )
    host = f"Host memory of the node ({est.settings.gpus_per_node} GPU processes):"
    return "\n\n".join([head, "\n".join(_phase_table(est.phases)), host, "\n".join(_phase_table(est.host_phases))])


def markdown() -> str:
    gpus = ", ".join(f"{g.name} {g.memory_bytes / GIB:.1f} GiB" for g in list_gpus())
    hosts = ", ".join(f"{g.name} {g.host_memory_bytes / GIB:.0f} GiB / {g.gpus_per_node} GPUs" for g in list_gpus())
    return "\n\n".join(
        [
            "#### Worked example: `rlctl estimate memory --model Qwen2.5-7B --method grpo --gpus 8 --gpu H100-80GB`",
            example(),
            "#### LLaMA-Factory (SFT, whole job on one GPU; rlctl at 1024 tokens, micro batch 1, checkpointing on)",
            llama_factory(),
            "#### torchtune (SFT, batch 2 x 2048 tokens, activation checkpointing; rlctl LoRA on q, v, o "
            "like torchtune's default)",
            torchtune(),
            "#### DeepSpeed ZeRO-3 model states (per GPU)",
            deepspeed_zero3(),
            (
                "#### verl minimum GPUs for GRPO (rlctl: prompt 512 + response 1024, n 8, 32 prompts per step, "
                "5% margin, host memory of the GPU type's node)"
            ),
            verl_min_gpus(),
            f"GPU memory as torch reports it: {gpus}.",
            f"Host memory per node (a rental of fewer GPUs gets its share): {hosts}.",
        ]
    )


BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"


def embedded(text: str) -> str:
    """The part of a document between the markers."""
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def write(path: str) -> None:
    from pathlib import Path

    doc = Path(path)
    text = doc.read_text()
    doc.write_text(text[: text.index(BEGIN) + len(BEGIN)] + "\n" + markdown() + "\n" + text[text.index(END) :])


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--write"]:
        write(sys.argv[2])
    else:
        print(markdown())
