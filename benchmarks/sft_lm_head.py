"""SFT's step with the LM head at the labelled positions only against every position, in one process.

``PYTHONPATH=. python benchmarks/sft_lm_head.py --vocab 32768,151936 --ratios 1:3,1:1,4:1 --reps 5 --json OUT``

A real :class:`rlctl.engines.fsdp.FSDPEngine` (one gloo rank, fp32, sdpa, one CPU thread) runs the recipe's
step: the global batch packed into micro-batches (``rank_micro_batches``, per-document attention), forward,
backward of :func:`rlctl.recipes.sft.sft_loss_sum`, AdamW. ``keep_labelled`` on (what ``rlctl sft`` runs) and
off (before) alternate, one step each, the order flipped every round; CPU seconds per step, median over
``--reps``. The model: a random Qwen2 of the dpo benchmark's layers (hidden 512, 4 layers; 11.27M layer
weights) with a ``--vocab`` row embedding and head. The data: sequences whose prompt and response lengths
are lognormal around ``--tokens`` x the ratio's shares (prompt:response), the prompt without labels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

MODEL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)


def build_model(path: Path, vocab: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**MODEL, vocab_size=vocab, max_position_embeddings=4096)).save_pretrained(path)


def examples(n: int, tokens: int, ratio: tuple[int, int], vocab: int, seed: int = 0) -> list:
    """``n`` sequences, prompt and response lognormal (sigma 0.5) around ``tokens`` split by ``ratio``."""
    import numpy as np

    from rlctl.data.sft import IGNORE, Example

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, r = (max(2, int(tokens * k / sum(ratio) * rng.lognormal(0, 0.5))) for k in ratio)
        ids = rng.integers(3, vocab, size=p + r)
        labels = np.roll(ids, -1)
        labels[: p - 1], labels[-1] = IGNORE, IGNORE  # position p-1 predicts the first response token
        out.append(Example(input_ids=ids, labels=labels))
    return out


def measure(model: Path, docs: list, budget: int, reps: int) -> dict:

    from rlctl.data.packing import rank_micro_batches
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.engines.spec import EngineSpec
    from rlctl.recipes.sft import sft_loss_sum

    spec = EngineSpec(backend="fsdp", device="cpu", dtype="fp32", attn="sdpa", model=str(model))
    engine = FSDPEngine(spec, role="actor", total_steps=2 * reps + 4)
    n_loss = sum(d.num_loss_tokens for d in docs)

    def step(keep: bool) -> float:
        micro = rank_micro_batches(docs, 0, 1, packing=True, budget=budget, micro_batch_size=1, pad_id=0,
                                   keep_labelled=keep)  # fmt: skip
        start = time.process_time()
        engine.forward_backward(micro, lambda out, mb: ((s := sft_loss_sum(out, mb)) / n_loss, s))
        engine.step()
        return time.process_time() - start

    step(True), step(False)  # warm-up: AdamW's states exist from here on
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(reps):
        for keep in (True, False) if r % 2 == 0 else (False, True):
            times[keep].append(step(keep))
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = sum(len(d) for d in docs)
    return {"tokens": tokens, "labelled_fraction": n_loss / tokens, "cpu_s_every_position": med[False],
            "cpu_s_labelled": med[True], "speedup": med[False] / med[True],
            "times": {"labelled": times[True], "every_position": times[False]}}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="32768,151936")
    ap.add_argument("--ratios", default="1:3,1:1,4:1", help="prompt:response token ratios")
    ap.add_argument("--tokens", type=int, default=256, help="median sequence length")
    ap.add_argument("--seqs", type=int, default=8, help="sequences per step")
    ap.add_argument("--budget", type=int, default=1024, help="tokens per packed micro-batch")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    import torch

    from rlctl.runtime.dist import init_distributed

    torch.set_num_threads(1)
    init_distributed("cpu")
    results = {"settings": vars(a), "uptime": [subprocess.run(["uptime"], capture_output=True, text=True).stdout]}
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in (int(v) for v in a.vocab.split(",")):
            build_model(Path(tmp) / f"v{vocab}", vocab)
            for ratio in a.ratios.split(","):
                p, r = (int(x) for x in ratio.split(":"))
                docs = examples(a.seqs, a.tokens, (p, r), vocab)
                m = measure(Path(tmp) / f"v{vocab}", docs, max(a.budget, max(len(d) for d in docs)), a.reps)
                results[f"v{vocab}_{ratio}"] = m
                print(f"vocab {vocab}, prompt:response {ratio} (labelled {m['labelled_fraction']:.2f}): every position "
                      f"{m['cpu_s_every_position']:.3f} CPU s, labelled only {m['cpu_s_labelled']:.3f}: "
                      f"x{m['speedup']:.2f}", flush=True)  # fmt: skip
    results["uptime"].append(subprocess.run(["uptime"], capture_output=True, text=True).stdout)
    print("uptime:", *results["uptime"])
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
