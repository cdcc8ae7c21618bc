"""CPU seconds of one hf-engine generate: the fast decode step (rlctl.rollout.hf_decode) vs the generic HF-forward loop.

    python benchmarks/hf_decode.py [--regimes overhead,compute] [--repeats 7]

The models and prompts are grpo_vs_trl's (``REGIMES``, ``build_models``): one generate is one GRPO
rollout of ``batch`` prompts x ``n`` samples x ``response_len`` tokens (sampled, temperature 1, the
same seed for both paths, so both decode the same tokens; the first prompts of the regime's data set,
chat-templated). One process, one thread; the two paths are timed interleaved (generic, fast,
generic, ...) after a warm-up of each, and the medians of ``process_time`` are reported, so other
load on a shared machine inflates both alike. Writes JSON (--json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from grpo_vs_trl import REGIMES, build_models  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from rlctl.rollout import RolloutSpec, SamplingParams, make_rollout_engine  # noqa: E402


def prompt_ids(model: Path, data: Path, count: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in data.read_text().splitlines()[:count]]
    out = []
    for row in rows:
        text = row["prompt"]
        if tokenizer.chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def measure(name: str, model: Path, data: Path, repeats: int) -> dict:
    r = REGIMES[name]
    prompts = prompt_ids(model, data, r.batch)
    sampling = SamplingParams(temperature=1.0, max_tokens=r.response_len, seed=0)
    engine = make_rollout_engine(
        RolloutSpec(engine="hf", model_path=str(model), device="cpu", dtype="float32", max_model_len=512)
    )
    assert engine._fast is not None, "the fast decode step does not apply to this model"
    times: dict[str, list[float]] = {"generic": [], "fast": []}
    outputs = {}
    for k in range(repeats + 1):
        for path in ("generic", "fast"):
            engine.fast_decode = path == "fast"
            t = time.process_time()
            samples = engine.generate(prompts, n=r.n, sampling=sampling)
            elapsed = time.process_time() - t
            if k:  # the first round warms up
                times[path].append(elapsed)
            outputs[path] = [(s.token_ids, s.logprobs) for s in samples]
    same_tokens = [t for t, _ in outputs["fast"]] == [t for t, _ in outputs["generic"]]
    max_dlogprob = max(
        abs(a - b)
        for (_, la), (_, lb) in zip(outputs["fast"], outputs["generic"], strict=True)
        for a, b in zip(la, lb, strict=True)
    )
    med = {path: statistics.median(v) for path, v in times.items()}
    tokens = sum(len(t) for t, _ in outputs["fast"])
    engine.close()
    return {
        "regime": asdict(r),
        "prompt_lens": [len(p) for p in prompts],
        "generated_tokens": tokens,
        "cpu_s": times,
        "median_cpu_s": med,
        "ratio_fast_over_generic": med["fast"] / med["generic"],
        "same_tokens": same_tokens,
        "max_abs_logprob_diff": max_dlogprob,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regimes", default="overhead,compute")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="runs/bench-hf-decode")
    ap.add_argument("--json", default="benchmarks/results/speed/hf-decode.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    names = args.regimes.split(",")
    built = build_models(Path(args.out), names)
    results = {}
    for name in names:
        res = results[name] = measure(name, *built[name], args.repeats)
        med = res["median_cpu_s"]
        print(
            f"{name:8s} generic {med['generic'] * 1e3:8.1f} ms  fast {med['fast'] * 1e3:8.1f} ms  "
            f"fast/generic {res['ratio_fast_over_generic']:.2f}  same tokens {res['same_tokens']}  "
            f"max |dlogprob| {res['max_abs_logprob_diff']:.1e}  ({res['generated_tokens']} tokens)",
            flush=True,
        )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(
        json.dumps({"args": vars(args), "torch": torch.__version__, "loadavg_1m": load, "results": results}, indent=1)
        + "\n"
    )


if __name__ == "__main__":
    main()
