"""rlctl's memory estimate beside published, MEASURED peak-memory figures of fine-tuning runs.

    python benchmarks/estimate_vs_published.py            # the table and the median absolute error
    python benchmarks/estimate_vs_published.py --write docs/benchmarks.md   # render it into the docs

Each figure names its source, the run's configuration as the source gives it, the quantity it
measured (``reserved``: torch's ``max_memory_reserved``; ``device``: the whole device as nvidia-smi
shows it, i.e. reserved plus the CUDA context), and whether rlctl can express the run. Figures of
runs rlctl cannot express (8-bit or paged optimizers, 4-bit base weights, DeepSpeed's buckets) are
listed with their reason and left out of the error statistics; so are other projects' *estimate*
tables (LLaMA-Factory's hardware table, Axolotl's ranges), which are not measurements.
Pure arithmetic: no torch, milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlctl.catalog import resolve_gpu, resolve_model  # noqa: E402
from rlctl.catalog.spec import ModelSpec  # noqa: E402
from rlctl.estimate.memory import GIB, MemorySettings, estimate_memory  # noqa: E402

QWEN_README = "https://github.com/QwenLM/Qwen/blob/main/README.md#profiling-of-memory-and-speed"
TORCHTUNE_README = "https://github.com/pytorch/torchtune/blob/main/README.md#memory-and-training-speed"


def _qwen1(size: str, hidden: int, inter: int, layers: int, heads: int, vocab: int) -> ModelSpec:
    """Qwen (v1): a Llama-like decoder with a fused, biased c_attn (counted as q/k/v with bias),
    full multi-head attention, SwiGLU (w1, w2 of width ``inter``), untied embeddings."""
    return ModelSpec(
        name=f"Qwen-{size}",
        hf_id=f"Qwen/Qwen-{size}",
        arch="qwen2",
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        vocab_size=vocab,
        qkv_bias=True,
        max_position=8192,
    )


QWEN1 = {
    "1.8B": _qwen1("1.8B", 2048, 5504, 24, 16, 151936),
    "7B": _qwen1("7B", 4096, 11008, 32, 32, 151936),
    "14B": _qwen1("14B", 5120, 13696, 40, 40, 152064),
}
# Qwen README, "Profiling of Memory and Speed": one A100-SXM4-80G, batch 1, FlashAttention 2, LoRA on
# every linear layer but the head (finetune.py: lora_r 64 on c_attn, c_proj, w1, w2; finetune_lora_single_gpu.sh:
# --bf16 --gradient_checkpointing, inputs padded to model_max_length). The README gives "G" without saying how it
# measured; it is compared with rlctl's device figure (reserved + CUDA context, as nvidia-smi shows it).
QWEN_LORA = {
    "1.8B": (6.7, 7.4, 8.4, 11.0, 16.2, 21.8),
    "7B": (20.1, 20.4, 21.5, 23.8, 29.7, 36.6),
    "14B": (34.6, 35.1, 35.3, 37.4, 42.5, 55.2),
}
QWEN_LENGTHS = (256, 512, 1024, 2048, 4096, 8192)


@dataclass
class Figure:
    label: str
    source: str
    config: str  # the run as its source states it
    measured_gib: float
    quantity: str  # reserved | device
    model: ModelSpec | None = None
    gpu: str = ""
    settings: dict = field(default_factory=dict)
    not_expressible: str = ""  # why rlctl cannot express the run ("" = it can)
    fits_on: str = ""  # the GPU the published run trained on (the verdict must say "fits")

    @property
    def counted(self) -> bool:
        return self.model is not None and not self.not_expressible

    def estimate(self):
        if self.model is None:
            return None
        s = MemorySettings(method="sft", device="cuda", **self.settings)
        return estimate_memory(self.model, resolve_gpu(self.gpu), s)

    def estimated_gib(self) -> float | None:
        est = self.estimate()
        if est is None:
            return None
        phase = est.phases["training"]
        return (phase.reserved_bytes if self.quantity == "reserved" else phase.total_bytes) / GIB


def figures() -> list[Figure]:
    out = []
    for size, row in QWEN_LORA.items():
        for length, gib in zip(QWEN_LENGTHS, row):
            out.append(
                Figure(
                    f"Qwen-{size} LoRA, {length} tokens",
                    QWEN_README,
                    f"1 x A100-80G, batch 1 padded to {length} tokens, HF Trainer without FSDP/DeepSpeed, LoRA r64 on "
                    "c_attn, c_proj, w1, w2 (every linear layer), --gradient_checkpointing, bf16, FlashAttention 2",
                    gib,
                    "device",
                    QWEN1[size],
                    "A100-80GB",
                    {"max_len": length, "lora_rank": 64, "activation_checkpointing": True, "shard": False},
                    fits_on="A100-80GB",
                )
            )
    llama8, llama70 = resolve_model("Llama-3.1-8B"), resolve_model("Llama-3.1-70B")
    tt = "batch 2 x 2048 packed tokens, activation checkpointing, chunked CE (8 chunks of 512), bf16"
    out += [
        Figure(
            "torchtune Llama-3.1-8B LoRA, 1 x RTX 4090",
            TORCHTUNE_README,
            f"8B_lora_single_device (no FSDP): r8 on q, v, output_proj and the MLP (the README's revision); {tt}",
            16.2,
            "reserved",
            llama8,
            "RTX-4090",
            {
                "shard": False,  # the single-device recipe: a plain module, no FSDP
                "max_len": 4096,
                "lora_rank": 8,
                "lora_targets": "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                "loss_chunk": 512,
                "precision": "bf16",
            },
            fits_on="RTX-4090",
        ),
        Figure(
            "torchtune Llama-3.1-70B LoRA, 8 x A100",
            TORCHTUNE_README,
            f"70B_lora (FSDP, head in the root unit): r16 on q, v, output_proj and the MLP; {tt}",
            27.6,
            "reserved",
            llama70,
            "A100-80GB",
            {
                "gpus": 8,
                "max_len": 4096,
                "lora_rank": 16,
                "lora_targets": "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                "loss_chunk": 512,
                "precision": "bf16",
            },
            fits_on="A100-80GB",
        ),
        Figure(
            "torchtune Llama-3.1-70B full, 8 x A100, CPU offload",
            TORCHTUNE_README,
            f"70B_full (FSDP, fsdp_cpu_offload, fused optimizer on the CPU); {tt}",
            13.9,
            "reserved",
            llama70,
            "A100-80GB",
            {
                "gpus": 8,
                "max_len": 4096,
                "loss_chunk": 512,
                "offload_params": True,
                "offload_optimizer": True,
                "precision": "bf16",
            },
            not_expressible="torchtune shards the output head as its own FSDP unit (custom_sharded_layers); rlctl's "
            "engine keeps it in the root unit, gathered with its gradient through the backward (about 4 GiB more here)",
            fits_on="A100-80GB",
        ),
        Figure(
            "torchtune Llama-3.1-8B LoRA, 1 x A6000",
            TORCHTUNE_README,
            f"same recipe as the RTX 4090 row; its settings on the A6000 are not stated; {tt}",
            30.3,
            "reserved",
            not_expressible="the row does not say what it changed from the 16.2 GiB run (same recipe, +14 GiB)",
        ),
        Figure(
            "torchtune Llama-3.1-8B full, 1 x RTX 4090",
            TORCHTUNE_README,
            f"8B_full_single_device: bf16 weights, bitsandbytes PagedAdamW8bit, optimizer in backward; {tt}",
            18.9,
            "reserved",
            not_expressible="8-bit paged AdamW (paged to host memory) and the optimizer step inside the backward",
        ),
        Figure(
            "torchtune Llama-3.1-8B full, 1 x A6000",
            TORCHTUNE_README,
            f"8B_full_single_device on an A6000; {tt}",
            37.4,
            "reserved",
            not_expressible="8-bit paged AdamW and the optimizer step inside the backward",
        ),
        Figure(
            "torchtune Llama-3.1-8B QLoRA, 1 x RTX 4090",
            TORCHTUNE_README,
            f"8B_qlora_single_device: NF4 base weights; {tt}",
            7.4,
            "reserved",
            not_expressible="4-bit (NF4) base weights",
        ),
    ]
    for size, row in (("7B", (11.5, 11.5, 12.3, 13.9, 16.9, 23.5)), ("14B", (18.7, 18.4, 18.9, 19.9, 23.0, 27.9))):
        out.append(
            Figure(
                f"Qwen-{size} Q-LoRA, 256-8192 tokens",
                QWEN_README,
                "1 x A100-80G, batch 1, Int4 (GPTQ) base weights",
                row[0],
                "device",
                not_expressible="4-bit (GPTQ) base weights",
            )
        )
    out.append(
        Figure(
            "Qwen-1.8B full-parameter, 256-2048 tokens",
            QWEN_README,
            "1 x A100-80G, batch 1; finetune_ds.sh (DeepSpeed ZeRO-2 buckets)",
            43.5,
            "device",
            not_expressible="DeepSpeed ZeRO-2 with its reduce and all-gather buckets (not an rlctl engine)",
        )
    )
    return out


ESTIMATE_TABLES = [
    ("LLaMA-Factory README hardware table", "https://github.com/hiyouga/LLaMA-Factory#hardware-requirement"),
    ("Axolotl docs, GPU ranges per method", "https://docs.axolotl.ai/"),
    ("verl docs, minimum GPUs that worked", "https://verl.readthedocs.io/en/latest/perf/device_tuning.html"),
]


def rows() -> list[dict]:
    out = []
    for f in figures():
        est = f.estimate()
        gib = f.estimated_gib()
        err = None if gib is None else (gib - f.measured_gib) / f.measured_gib
        out.append(
            {
                "figure": f,
                "estimate_gib": gib,
                "error": err,
                "verdict_ok": None if est is None else est.fits,
            }
        )
    return out


def render() -> str:
    rs = rows()
    counted = [r for r in rs if r["figure"].counted]
    errors = [abs(r["error"]) for r in counted]
    lines = [
        "| run | source | configuration | measured | quantity | rlctl | error | fits verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        f = r["figure"]
        if r["error"] is None:
            rl, err, ok = "not expressible", f.not_expressible, "-"
        elif not f.counted:
            rl = f"{r['estimate_gib']:.1f} GiB (rlctl's engine)"
            err = f"{r['error']:+.1%}, not counted: {f.not_expressible}"
            ok = f"fits on {f.gpu} (right)" if r["verdict_ok"] else f"does not fit on {f.gpu} (WRONG)"
        else:
            rl, err = f"{r['estimate_gib']:.1f} GiB", f"{r['error']:+.1%}"
            ok = f"fits on {f.gpu} (right)" if r["verdict_ok"] else f"does not fit on {f.gpu} (WRONG)"
        lines.append(
            f"| {f.label} | [{f.source.split('/')[4]}]({f.source}) | {f.config} | {f.measured_gib:.1f} GiB "
            f"| {f.quantity} | {rl} | {err} | {ok} |"
        )
    verdicts = sum(bool(r["verdict_ok"]) for r in counted)
    lines += [
        "",
        f"Median absolute error over the {len(counted)} expressible measured figures: "
        f"**{statistics.median(errors):.1%}** (largest {max(errors):.1%}); fits verdict right for "
        f"{verdicts} of {len(counted)}.",
        "",
        "Not counted (estimates, not measurements): "
        + "; ".join(f"[{name}]({url})" for name, url in ESTIMATE_TABLES)
        + ".",
    ]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- estimate-vs-published:begin -->", "<!-- estimate-vs-published:end -->"
HEADING = (
    "## Memory estimate vs published measurements\n\n"
    "`python benchmarks/estimate_vs_published.py --write docs/benchmarks.md` renders this section: measured "
    "peak-memory figures of other frameworks' runs (each with its source and configuration) beside "
    "`rlctl estimate memory` for the same run; formulas in docs/estimate.md.\n\n"
)


HAND_END = "<!-- hand-written: end -->"  # make_benchmarks_md.py keeps what is above it


def write(path: Path, table: str) -> None:
    """Put the table in its section of the hand-written part of ``path`` (replacing an older one)."""
    text = path.read_text() if path.exists() else ""
    title = HEADING.split("\n", 1)[0]
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        head = head[: head.rfind(title)] if title in head else head
        text = head.rstrip("\n") + "\n\n" + rest.split(END, 1)[1].lstrip("\n")
    section = f"{HEADING}{BEGIN}\n{table}{END}\n\n"
    if HAND_END in text:
        head, rest = text.split(HAND_END, 1)
        text = head.rstrip("\n") + "\n\n" + section + HAND_END + rest
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="render the table into this markdown file")
    args = ap.parse_args()
    table = render()
    if args.write:
        write(args.write, table)
    sys.stdout.write(table)


if __name__ == "__main__":
    main()
