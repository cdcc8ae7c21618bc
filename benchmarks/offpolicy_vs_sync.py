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
WARMUP, then the median over rounds.

The cost model, for a batch of ``T`` response tokens whose longest response has ``L`` tokens. Every
part is measured apart from the sync2 run it predicts: in the split run (two busy processes, as in
sync2: on a shared machine a process's speed depends on what runs beside it, so the 1-process column is
not an input) and in a data-parallel micro-benchmark (:func:`dp_parts`):

* rollout on one process: ``R(L, T) = a L + b T`` (the hf engine decodes until the longest sample
  finishes; a finished sample leaves the batch), ``a`` and ``b`` fitted by least squares on the split
  run's steps (``time/rollout``, the rollout process's generation, against ``response_len/max`` and the
  response tokens);
* ``U``: the trainer's part of a split step (scoring, log-probs, update; ``time/step`` less the wait for
  the batch and the weight broadcast), for the whole batch on one process;
* ``S``: the weight broadcast after an update (``time/weight_sync``);
* ``f``: the load imbalance of sync2 (:func:`imbalance`): each rank trains its own half of the samples
  and the other waits for the busier at the next collective, so a step costs the busier rank's share,
  ``f`` times the even one; from the split run's ``response_len/std``, ``response_len/mean`` and tokens;
* ``C_dp``: what 2 data-parallel processes pay per step that one does not (:func:`counts`, :func:`dp_parts`):
  FSDP's all-gathers and gradient reduce-scatters per micro-batch (``fb``; ``fwd`` for a log-prob pass),
  the gradient norm's all-reduce per optimizer step, and the recipe's small metric collectives, each the
  micro-benchmark's 2-process time less its 1-process time, times the count of the config;
* ``S_gather``: the FSDP parameters gathered every step for sync2's own hf rollout engine (the
  micro-benchmark on 2 processes);
* ``sync2 = a L + b (T/2) f + (U/2) f + C_dp + S_gather``: each rank decodes half the tokens (the busier
  rank ``f`` times that), but the rank holding the longest response decodes for ``L`` steps and the other
  waits for it at the first collective; the update halves, times ``f``;
* ``split = median over i, j of max(R(L_i, T_i), U_j) + S``: the trainer waits for the rollout when it
  is slower, the rollout for the weights when the update is; batch t+1's rollout and batch t's update
  are independent draws from the steps' distributions, so the step costs the slower of two draws, which
  is more than the slower of the two medians when both are close (every rollout of the split run,
  through the fitted ``R``, paired with every update).

``L``, ``T``, ``U``, ``S`` and ``f`` are medians over the split steps after WARMUP. The predicted ratio
split / sync2 is compared with the measured one (the median over rounds of the per-round ratio); each
config's line prints both, the error and every part. A run directory with its ``load.txt`` and the
micro-benchmark's ``WORK/dp_parts.json`` are reused by a later call (so a call on an existing WORK only
recomputes the model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STOP_IDS = [3, 100, 101, 102, 103, 104]  # 3: the tokenizer's EOS; the others make lengths geometric
WARMUP = 2
DP_REPS = 30  # reps of each part in the data-parallel micro-benchmark
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


def imbalance(r: dict) -> float:
    """``f``: the expected tokens of the busier of two ranks over the even share, for the step's samples
    split in two halves of ``n = batch * N / 2``: a rank's tokens are its prompts (nearly the same on both)
    plus the sum of ``n`` response lengths of standard deviation ``s``; for two such sums (normal
    approximation) ``E[max] = mean + s sqrt(n) / sqrt(pi)``, so ``f = 1 + s sqrt(n) / (sqrt(pi) tokens / 2)``.
    ``s`` is ``response_len/std``; a run from before that metric: the geometric lengths' ``sqrt(m (m - 1))``."""
    m = r["response_len/mean"]
    s = r.get("response_len/std", math.sqrt(max(0.0, m * (m - 1))))
    n = r["batch"] * N / 2
    return 1 + s * math.sqrt(n) / (math.sqrt(math.pi) * r["tokens"] / 2)


def counts(cfg, batch: int, rank_tokens: float) -> dict:
    """What sync2 runs per step on each rank, counted from its config as the engine does: micro-batches of
    a pass over the rank's samples (``rank_tokens`` packed under the token budget), the optimizer steps
    (``ppo_epochs`` x mini-batches), the log-prob passes before the update (none when the update's own
    forward gives the old log-probs), and the small metric collectives of the recipe (``global_sums``,
    maxima, gathers: about 10 per step for the rewards, lengths, advantages and the update's metrics, 2 per
    log-prob pass, 2 per optimizer step; see rlctl/recipes/rl)."""
    from rlctl.recipes.rl.batch import token_budget
    from rlctl.recipes.rl.update import skips_old_logprobs

    minis = math.ceil(batch / (cfg.algo.mini_batch_size or batch))
    micro, per_mini = (max(1, math.ceil(rank_tokens / k / token_budget(cfg))) for k in (1, minis))
    opt = cfg.algo.ppo_epochs * minis
    passes = 0 if skips_old_logprobs(cfg) else 1
    return {"micro_per_pass": micro, "opt_steps": opt, "fb_micro": opt * per_mini, "fwd_micro": passes * micro,
            "small": 10 + 2 * passes + 2 * opt}  # fmt: skip


def model_ratio(split: list[dict], dp: dict, cfg) -> dict:
    """The cost model's parts, measured in the split run (two busy processes, as in sync2) and by the
    data-parallel micro-benchmark ``dp`` (:func:`dp_parts`), and its predictions of both step times."""
    a, b = fit_rollout(split)
    med = statistics.median
    L, T = med(r["response_len/max"] for r in split), med(response_tokens(r) for r in split)
    updates = [r["time/step"] - r["time/rollout_wait"] - r["time/weight_sync"] for r in split]
    U = med(updates)
    S = med(r["time/weight_sync"] for r in split)
    f = med(imbalance(r) for r in split)
    n = counts(cfg, split[0]["batch"], med(r["tokens"] for r in split) / 2 * f)
    C = n["fb_micro"] * dp["fb"] + n["fwd_micro"] * dp["fwd"] + n["opt_steps"] * dp["step"] + n["small"] * dp["sums"]
    R1, R2 = a * L + b * T, a * L + b * T / 2 * f
    rollouts = [a * r["response_len/max"] + b * response_tokens(r) for r in split]
    sync2, split_s = R2 + U / 2 * f + C + dp["gather"], med(max(r, u) for r in rollouts for u in updates) + S
    return {"a_s_per_step": a, "b_s_per_token": b, "L": L, "T": T, "f": f, "R1": R1, "R2": R2, "U": U,
            "U2f": U / 2 * f, "S": S, "C_dp": C, "S_gather": dp["gather"], "counts": n,
            "sync2_pred": sync2, "split_pred": split_s, "ratio_pred": split_s / sync2}  # fmt: skip


def summarize(recs: dict[str, list[list[dict]]], dp: dict, cfg) -> dict:
    """Medians over rounds, the measured ratio split / sync2 and the cost model's."""
    modes = list(recs)
    flat = {m: [r for rr in recs[m] for r in rr] for m in modes}
    per_round = {m: [statistics.median(r["time/step"] for r in rr) for rr in recs[m]] for m in modes}
    ratios = [s / y for s, y in zip(per_round["split"], per_round["sync2"])]
    cost = model_ratio(flat["split"], dp["median"], cfg)
    # the same with the micro-benchmark's fastest reps: far from ``ratio_pred``, the machine was loaded
    cost["ratio_pred_fastest_dp"] = model_ratio(flat["split"], dp["fastest"], cfg)["ratio_pred"]
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


def report(config: str, s: dict) -> str:
    """One config's measured and predicted ratio, the error, and each part of the model (seconds)."""
    m, t = s["model"], s["s_per_step"]
    parts = " ".join(f"{k}={m[k]:.4g}" for k in ("R1", "U", "S", "R2", "U2f", "C_dp", "S_gather", "f", "L", "T"))
    return (f"{config}: split/sync2 measured {s['ratio_split_over_sync2']:.3f} ({t['split']:.3f}/{t['sync2']:.3f} s),"
            f" predicted {m['ratio_pred']:.3f} ({m['split_pred']:.3f}/{m['sync2_pred']:.3f} s), error "
            f"{s['model_error']:+.1%} (with the micro-benchmark's fastest reps {m['ratio_pred_fastest_dp']:.3f})"
            f"\n  parts: {parts} counts={m['counts']}")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# The data-parallel micro-benchmark: what sync2's two processes pay that one process does not


def dp_worker(run_dir: Path, out: Path) -> None:
    """Under torchrun: the actor engine of ``run_dir``'s config on this many processes, and the seconds
    of each data-parallel part on a one-token micro-batch (the slowest rank, median over DP_REPS reps,
    each after a barrier): ``fwd`` a no-grad forward (a log-prob pass), ``fb`` a forward and backward
    (FSDP's all-gathers and gradient reduce-scatters), ``step`` an optimizer step (the gradient norm's
    all-reduce), ``gather`` every full parameter (the weight sync to the hf rollout), ``sums`` one small
    ``global_sums``."""
    import torch
    import torch.distributed as dist

    from rlctl.config import load_config
    from rlctl.data.packing import MicroBatch
    from rlctl.engines import EngineSpec, build_engine
    from rlctl.engines.base import model_source
    from rlctl.runtime.dist import all_gather_objects, global_sums, init_distributed

    cfg = load_config(run_dir / "config.yaml")
    d = init_distributed("cpu")
    engine = build_engine(EngineSpec.from_config(cfg), role="actor", total_steps=10**6,
                          source=model_source(cfg.model.name))  # fmt: skip
    one = torch.zeros((1, 1), dtype=torch.int64)
    mb = [MicroBatch(one, one, one[0], logit_index=torch.zeros(1, dtype=torch.int64))]

    def loss(out, _mb):
        return out.float().sum(), None

    def fwd():
        engine.train(False)
        engine.forward_backward(mb, loss, forward_only=True)
        engine.train(True)

    ops = {"fwd": fwd, "fb": lambda: engine.forward_backward(mb, loss), "step": engine.step,
           "gather": lambda: [t.clone() for _, t in engine.iter_full_params(dtype=torch.float32)],
           "sums": lambda: global_sums({"a": 1.0, "b": 2.0, "c": 3.0}, d.device)}  # fmt: skip
    times: dict[str, list[float]] = {k: [] for k in ops}
    for rep in range(DP_REPS + 3):  # 3 warmup reps
        for key, op in ops.items():  # fb then step: the step has gradients to clip
            dist.barrier()
            began = time.perf_counter()
            op()
            if rep >= 3:
                times[key].append(time.perf_counter() - began)
    every = all_gather_objects(times)
    if d.rank == 0:
        slowest = {k: [max(t[k][i] for t in every) for i in range(DP_REPS)] for k in ops}
        fastest = {f"{k}_min": min(v) for k, v in slowest.items()}  # a check against the load
        out.write_text(json.dumps({**{k: statistics.median(v) for k, v in slowest.items()}, **fastest}) + "\n")
    dist.destroy_process_group()


def dp_parts(work: Path, run_dir: Path) -> dict:
    """The micro-benchmark on 2 processes and on 1 (cached in WORK/dp_parts.json): the parts of a step
    sync2 pays beyond the split trainer, ``fwd``, ``fb``, ``step``, ``sums`` as the 2-process time less
    the 1-process one (the split trainer runs the same engine on one process: its compute is in U), and
    ``gather`` whole (sync2's rollout engine is loaded from the gathered parameters every step). The
    real engine on a one-token micro-batch rather than bare collectives of the same sizes: it pays what
    FSDP2 really does (an all-gather per decoder layer before the forward and again before the backward,
    the reduce-scatters, the copies in and out, DTensor's bookkeeping), and the 1-process run removes the
    compute that the split trainer's ``U`` already holds. ``median``: the medians over the reps (the
    model's input); ``fastest``: the same from the fastest reps (a check: far apart, the machine was loaded)."""
    cache = work / "dp_parts.json"
    if not cache.is_file():
        procs = {}
        for p in (2, 1):
            out = work / f"dp_{p}.json"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(p),
                   __file__, "--dp-worker", str(run_dir), "--dp-out", str(out)]  # fmt: skip
            result = subprocess.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True)
            if result.returncode:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
            procs[p] = json.loads(out.read_text())
        parts = {
            stat: {
                **{k: max(0.0, procs[2][k + sfx] - procs[1][k + sfx]) for k in ("fwd", "fb", "step", "sums")},
                "gather": procs[2]["gather" + sfx],
            }  # fmt: skip
            for stat, sfx in (("median", ""), ("fastest", "_min"))
        }
        cache.write_text(json.dumps({**parts, "procs2": procs[2], "procs1": procs[1]}))
    return json.loads(cache.read_text())


def run_config(work: Path, model: Path, data: Path, config: str, rounds: int, steps: int) -> dict:
    """The runs of one config, interleaved: each mode's records per round."""
    batch, epochs = (int(v) for v in config.split("x"))
    modes = ["sync1", "sync2", "split"]
    recs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for rnd in range(rounds):
        for m in modes[rnd % 3 :] + modes[: rnd % 3]:
            out = work / f"b{batch}-e{epochs}-{m}-{rnd}"
            began = time.time()
            recs[m].append(run(argv(model, data, out, m, steps, batch, epochs), out))
            for r in recs[m][-1]:
                r["batch"] = batch
            step = statistics.median(r["time/step"] for r in recs[m][-1])
            print(f"{config} round {rnd} {m}: {step:.2f} s/step ({time.time() - began:.0f} s, "
                  f"load {recs[m][-1][0]['load']:.1f})", flush=True)  # fmt: skip
    return recs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--configs", default="8x1,4x1,8x4", help="BATCHxPPO_EPOCHS, comma-separated")
    p.add_argument("--work", default="/tmp/offpolicy_bench")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "offpolicy_vs_sync.json"))
    p.add_argument("--dp-worker", type=Path, help=argparse.SUPPRESS)  # the micro-benchmark's ranks
    p.add_argument("--dp-out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.dp_worker:
        return dp_worker(args.dp_worker, args.dp_out)
    from rlctl.config import load_config

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, data = setup(work)
    configs = args.configs.split(",")
    recs = {c: run_config(work, model, data, c, args.rounds, args.steps) for c in configs}
    runs = {c: work / "b{}-e{}-sync2-0".format(*c.split("x")) for c in configs}
    dp = dp_parts(work, runs[configs[0]])
    print(f"data-parallel parts (s): {json.dumps(dp)}", flush=True)
    results = json.loads(Path(args.out).read_text())["results"] if Path(args.out).is_file() else {}
    lines = []
    for c in configs:
        batch, epochs = c.split("x")
        results[f"batch={batch},ppo_epochs={epochs}"] = s = summarize(recs[c], dp, load_config(runs[c] / "config.yaml"))
        lines.append(report(c, s))
    out = {"setup": {"n": N, "max_response_len": RESPONSE, "stop_ids": STOP_IDS,
                     "rounds": args.rounds, "steps": args.steps, "warmup": WARMUP, "cpus": os.cpu_count()},
           "dp_parts": dp, "results": results}  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
