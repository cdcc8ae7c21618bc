"""Step time of one-step-off-policy GRPO (1 rollout + 1 trainer process) against synchronous 2-process
GRPO, with long-tailed response lengths, on this CPU; and the cost model that predicts their ratio.

    python benchmarks/offpolicy_vs_sync.py [--rounds 3] [--steps 10] [--configs 8x1,4x1,8x4] [--out FILE.json]

The model is the tests' tiny Qwen2 (rlctl.testing.build_tiny_model, random init, vocabulary 512) whose
generation_config.json names STOP_IDS as end-of-sequence tokens: the random policy samples almost
uniformly, so a response stops after each token with probability ~len(STOP_IDS)/512 and the lengths are
geometric, from a few tokens to the 512-token cap (a long tail: the longest of a batch of 32 is ~400
tokens, the mean ~100). The learning rate is tiny so that the lengths stay put over a run.

Columns, run interleaved (every column once per round, in a rotating order) on 2 cores:

* ``sync1``: 1 process, generates then trains the whole batch (for reference; not an input of the model).
* ``sync2``: 2 processes, data parallel: each generates and trains half the batch.
* ``split``: ``--rollout-procs 1``: 1 process generates batch t+1 while the other trains batch t.

``--configs BATCHxEPOCHS,...``: prompts per step (4 samples each) and ``algo.ppo_epochs`` of each
comparison: 8x1 (the update a bit slower than the rollout), 4x1 (fewer tokens: both shrink but the
longest response does not, so the rollout and the update cost about the same), 8x4 (the update four
times as long: it dominates). Seconds per step: the median of ``time/step`` over the steps after
WARMUP, then the median over rounds. A run directory with its ``load.txt`` is reused by a later call.

The cost model, for a batch of ``T`` response tokens whose longest response has ``L`` tokens, with
its parts measured in the split run (two busy processes, as in sync2: on a shared machine a process's
speed depends on what runs beside it, so the 1-process column is not used as input):

* rollout on one process: ``R(L, T) = a L + b T`` (the hf engine decodes until the longest sample
  finishes; a finished sample leaves the batch), ``a`` and ``b`` fitted by least squares on the split
  run's steps (``time/rollout``, the rollout process's generation, against ``response_len/max`` and the
  response tokens);
* ``U``: the trainer's part of a split step (scoring, log-probs, update; ``time/step`` less the wait for
  the batch and the weight broadcast), for the whole batch on one process;
* ``S``: the weight broadcast after an update (``time/weight_sync``);
* ``sync2 = R(L, T/2) + U/2``: each rank decodes half the tokens, but the rank holding the longest
  response decodes for ``L`` steps and the other waits for it at the first collective; the update
  halves (the gradient all-reduce of the tiny model is left out);
* ``split = max(R(L, T), U) + S``: the trainer waits for the rollout when it is slower, the rollout
  for the weights when the update is.

``L``, ``T``, ``U`` and ``S`` are medians over the split steps after WARMUP. The predicted ratio
split / sync2 is compared with the measured one (the median over rounds of the per-round ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STOP_IDS = [3, 100, 101, 102, 103, 104]  # 3: the tokenizer's EOS; the others make lengths geometric
WARMUP = 2
N, RESPONSE = 4, 512


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(REPO)}  # fmt: skip


def setup(work: Path) -> tuple[Path, Path]:
    """The tiny model with STOP_IDS as EOS, and 64 addition prompts."""
    from rlctl.testing import build_tiny_model

    model = work / "model"
    if not (model / "config.json").is_file():
        build_tiny_model(model, seed=0)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 1024  # room for the prompt and a 512-token response (RoPE)
    (model / "config.json").write_text(json.dumps(config, indent=2))
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = STOP_IDS
    (model / "generation_config.json").write_text(json.dumps(gen, indent=2))
    data = work / "data.jsonl"
    rows = [{"prompt": f"What is {a} + {3 * a % 97}?", "answer": str(a + 3 * a % 97)} for a in range(64)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, data


def argv(model: Path, data: Path, out: Path, mode: str, steps: int, batch: int, epochs: int) -> list[str]:
    a = [sys.executable, "-m", "rlctl", "grpo", "--model", str(model), "--data", str(data), "-o", str(out)]
    a += ["--device", "cpu", "--rollout", "hf", "--max-steps", str(steps), "--batch-size", str(batch)]
    a += ["--n", str(N), "--max-prompt-len", "48", "--max-response-len", str(RESPONSE), "--lr", "1e-7"]
    a += ["--reward", "exact", "--kl-coef", "0", "--seed", "0", "--set", "checkpoint.export_hf=false"]
    a += ["--set", f"algo.ppo_epochs={epochs}", "--set", "checkpoint.save_every=0"]
    a += {"sync1": ["--nproc", "1"], "sync2": ["--nproc", "2"], "split": ["--nproc", "2", "--rollout-procs", "1"]}[mode]
    return a


def run(cmd: list[str], out: Path) -> list[dict]:
    """The training records of one run (after WARMUP); a completed run of an earlier call is reused."""
    if not (out / "load.txt").is_file():
        subprocess.run(["rm", "-rf", str(out)])
        load = os.getloadavg()[0]
        result = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
        (out / "load.txt").write_text(f"{load}\n")
    load = float((out / "load.txt").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r.get("kind") != "eval" and r["step"] > WARMUP]
    for r in records:
        r["load"] = load
    return records


def fit_rollout(records: list[dict]) -> tuple[float, float]:
    """Least squares ``time/rollout = a L + b T`` (no intercept) over steps, with ``a, b >= 0`` (a time
    per decoding step and per token cannot be negative; L and T move together, so a free fit of noisy
    steps can give one a negative sign: then the other alone is fitted)."""
    xs = [(r["response_len/max"], response_tokens(r)) for r in records]
    ys = [r["time/rollout"] for r in records]
    s11 = sum(x[0] * x[0] for x in xs)
    s12 = sum(x[0] * x[1] for x in xs)
    s22 = sum(x[1] * x[1] for x in xs)
    t1 = sum(x[0] * y for x, y in zip(xs, ys))
    t2 = sum(x[1] * y for x, y in zip(xs, ys))
    det = s11 * s22 - s12 * s12
    a, b = (t1 * s22 - t2 * s12) / det, (s11 * t2 - s12 * t1) / det
    if b < 0:
        return t1 / s11, 0.0
    if a < 0:
        return 0.0, t2 / s22
    return a, b


def response_tokens(r: dict) -> float:
    """Response tokens of the step (``response_len/mean`` x samples)."""
    return r["response_len/mean"] * r["batch"] * N


def model_ratio(split: list[dict]) -> dict:
    """The cost model's parts, measured in the split run (two busy processes, as in sync2), and its
    predictions of both step times."""
    a, b = fit_rollout(split)
    med = statistics.median
    L, T = med(r["response_len/max"] for r in split), med(response_tokens(r) for r in split)
    U = med(r["time/step"] - r["time/rollout_wait"] - r["time/weight_sync"] for r in split)
    S = med(r["time/weight_sync"] for r in split)
    R1, R2 = a * L + b * T, a * L + b * T / 2
    sync2, split_s = R2 + U / 2, max(R1, U) + S
    return {"a_s_per_step": a, "b_s_per_token": b, "L": L, "T": T, "R1": R1, "R2": R2, "U": U, "S": S,
            "sync2_pred": sync2, "split_pred": split_s, "ratio_pred": split_s / sync2}  # fmt: skip


def summarize(recs: dict[str, list[list[dict]]]) -> dict:
    """Medians over rounds, the measured ratio split / sync2 and the cost model's."""
    modes = list(recs)
    flat = {m: [r for rr in recs[m] for r in rr] for m in modes}
    per_round = {m: [statistics.median(r["time/step"] for r in rr) for rr in recs[m]] for m in modes}
    ratios = [s / y for s, y in zip(per_round["split"], per_round["sync2"])]
    cost = model_ratio(flat["split"])
    return {
        "s_per_step": {m: statistics.median(v) for m, v in per_round.items()},
        "s_per_step_rounds": per_round,
        "ratio_split_over_sync2": statistics.median(ratios),
        "ratio_rounds": ratios,
        "model": cost,
        "model_error": cost["ratio_pred"] / statistics.median(ratios) - 1,
        "split_wait_s": statistics.median(r["time/rollout_wait"] for r in flat["split"]),
        "load": statistics.median(r["load"] for m in modes for r in flat[m]),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--configs", default="8x1,4x1,8x4", help="BATCHxPPO_EPOCHS, comma-separated")
    p.add_argument("--work", default="/tmp/offpolicy_bench")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "offpolicy_vs_sync.json"))
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, data = setup(work)
    modes = ["sync1", "sync2", "split"]
    results = json.loads(Path(args.out).read_text())["results"] if Path(args.out).is_file() else {}
    for config in args.configs.split(","):
        batch, epochs = (int(v) for v in config.split("x"))
        recs: dict[str, list[list[dict]]] = {m: [] for m in modes}
        for rnd in range(args.rounds):
            for m in modes[rnd % 3 :] + modes[: rnd % 3]:
                out = work / f"b{batch}-e{epochs}-{m}-{rnd}"
                began = time.time()
                recs[m].append(run(argv(model, data, out, m, args.steps, batch, epochs), out))
                for r in recs[m][-1]:
                    r["batch"] = batch
                step = statistics.median(r["time/step"] for r in recs[m][-1])
                print(f"{config} round {rnd} {m}: {step:.2f} s/step ({time.time() - began:.0f} s, "
                      f"load {recs[m][-1][0]['load']:.1f})", flush=True)  # fmt: skip
        results[f"batch={batch},ppo_epochs={epochs}"] = summarize(recs)
        print(json.dumps(results[f"batch={batch},ppo_epochs={epochs}"], indent=1), flush=True)
    out = {"setup": {"n": N, "max_response_len": RESPONSE, "stop_ids": STOP_IDS,
                     "rounds": args.rounds, "steps": args.steps, "warmup": WARMUP, "cpus": os.cpu_count()},
           "results": results}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
