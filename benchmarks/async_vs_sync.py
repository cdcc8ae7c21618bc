"""Streaming (fully asynchronous) RL against synchronous and one-step-off, on a multi-turn tool workload.

    python benchmarks/async_vs_sync.py [--rounds 3] [--steps 10] [--seeds 0,1] [--out FILE.json]

A harness, not the ``rlctl grpo`` CLI run (that is ``benchmarks/async_vs_sync_cli.py``): the
parts are rlctl's own (the hf rollout engine, :class:`rlctl.rollout.streaming.StreamingPool`,
:class:`rlctl.algos.admission.Admission`, the decoupled objective), the trainer a plain AdamW update of
the tiny Qwen2 (rlctl.testing) on 2 processes of this 2-core machine.

The workload: 4 prompts x 4 trajectories a step; each trajectory makes a geometric number of tool calls
(mean TOOL_CALLS, at most MAX_TURNS - 1), each turn's length is geometric (STOP_IDS end a turn; mean ~24
tokens, cap MAX_RESPONSE tokens in all), each tool sleeps an exponential time (mean TOOL_S: latency that
costs no CPU) and appends 3 tokens. The reward is the share of sampled tokens below 256 (learnable).

Columns, interleaved (every column once per round, in a rotating order), each ``--steps`` updates:

* ``sync2``: 2 processes, data parallel: each runs its half of the batch's trajectories turn by turn in
  lockstep (rlctl.agents.loop's schedule: the next turn waits for every tool of the batch), then both
  update with gradients all-reduced (gloo);
* ``offpolicy``: 1 rollout + 1 trainer process, the fixed schedule (batch t from the weights after update
  t - 1), lockstep turns;
* ``stream``: 1 rollout + 1 trainer process: a pool of in-flight trajectories (chunks of CHUNK tokens,
  tools in threads beside generation), admission ``--max-staleness``, in-flight weight updates.

Seconds per update, over the updates after WARMUP: ``mean_step_s`` (their wall time per update, i.e.
throughput; since run 4) and ``step_s`` (the median update, all runs; a stream's updates come in bursts,
so its median lies below its mean); medians over rounds. Reward per trajectory: the mean over a run's
trained trajectories, paired by seed across columns. The cost model (rlctl.plan.streaming) predicts each
ratio from parts measured in the same round (``stream_parts``), never fitted to a ratio; the report
prints predicted against measured for each ratio and the miss in % (docs/async.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH, N = 4, 4
MAX_RESPONSE, MAX_TURNS, TOOL_CALLS, TOOL_S, CHUNK = 160, 5, 1.5, 0.25, 16
STOP_IDS = list(range(300, 321))  # 21 of 512 ids: turns ~24 tokens
WARMUP = 2
LR = 2e-4


class Tool:
    """Geometric number of calls, exponential sleeps; appends 3 tokens."""

    def __init__(self, rng: random.Random):
        self.calls = 0
        while self.calls < MAX_TURNS - 1 and rng.random() < TOOL_CALLS / (1 + TOOL_CALLS):
            self.calls += 1
        self.sleeps = [rng.expovariate(1 / TOOL_S) for _ in range(self.calls)]
        self.tool_s = 0.0

    def after_turn(self, turn_ids):
        if not self.sleeps:
            return None
        s = self.sleeps.pop()
        time.sleep(s)
        self.tool_s += s
        return [7, 8, 9]

    def reward(self):
        return 0.0


def reward_of(t) -> float:
    sampled = [x for x, m in zip(t.token_ids, t.mask) if m]
    return sum(x < 256 for x in sampled) / max(1, len(sampled))


def prompts_for(seed: int):
    def make(k: int):
        rng = random.Random(seed * 1_000_003 + k)
        return k, [rng.randrange(10, 290) for _ in range(8)], [Tool(rng) for _ in range(N)]

    return make


# ---------------------------------------------------------------------------------------------------- rollout


def lockstep(engine, groups, sampling, executor):
    """rlctl.agents.loop's schedule on StreamTrajectory records: a turn for every going trajectory, then
    every tool of the batch, then the next turn."""
    from rlctl.rollout.streaming import StreamTrajectory

    trajs = [StreamTrajectory(k, ids, ep) for k, ids, eps in groups for ep in eps]
    going, turn, gen_s = list(trajs), 0, 0.0
    while going:
        budgets = [MAX_RESPONSE - len(t.token_ids) for t in going]
        began = time.perf_counter()
        out = engine.continue_generation(
            [t.history for t in going], replace(sampling, seed=sampling.seed + turn), budgets
        )
        gen_s += time.perf_counter() - began
        turn += 1
        results = list(executor.map(lambda ts: ts[0].episode.after_turn(ts[1].token_ids), zip(going, out)))
        nxt = []
        for t, s, extra in zip(going, out, results):
            t.token_ids += s.token_ids
            t.mask += [1] * len(s.token_ids)
            t.logprobs += list(s.logprobs)
            t.versions += [0] * len(s.token_ids)
            if (
                extra is None
                or s.finish_reason == "length"
                or len(t.token_ids) + 3 >= MAX_RESPONSE
                or turn >= MAX_TURNS
            ):
                continue
            t.token_ids += extra
            t.mask += [0] * 3
            t.logprobs += [0.0] * 3
            t.versions += [-1] * 3
            nxt.append(t)
        going = nxt
    return trajs, gen_s


def make_engine(model_dir):
    from rlctl.rollout import RolloutSpec, make_rollout_engine

    return make_rollout_engine(
        RolloutSpec(engine="hf", model_path=str(model_dir), device="cpu", dtype="float32", max_model_len=512, seed=1)
    )


def sampling_for(seed):
    from rlctl.rollout.base import SamplingParams

    return SamplingParams(temperature=1.0, seed=seed, stop_token_ids=STOP_IDS, max_tokens=MAX_RESPONSE)


def pack(trajs, version_of=None):
    return [
        {"prompt": t.prompt_ids, "tokens": t.token_ids, "mask": t.mask, "logprobs": t.logprobs, "versions": t.versions}
        for t in trajs
    ]


# ---------------------------------------------------------------------------------------------------- trainer


class Trainer:
    def __init__(self, model_dir):
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        lr = float(os.environ.get("AVS_LR", LR))  # --lr (the spawned processes inherit the environment)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def loss(self, trajs, version: int):
        """Group-normalised advantages; the decoupled objective (prox = these weights, behaviour = the
        recorded log-probs; = PPO's clipped loss on fresh samples)."""
        import torch

        from rlctl.algos.decoupled import decoupled_ppo_loss

        rewards = torch.tensor([reward_of_row(t) for t in trajs])
        r = rewards.view(-1, N)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
        width = max(len(t["prompt"]) + len(t["tokens"]) for t in trajs)
        ids = torch.zeros(len(trajs), width, dtype=torch.long)
        mask = torch.zeros(len(trajs), width - 1)
        behav = torch.zeros(len(trajs), width - 1)
        for i, t in enumerate(trajs):
            seq = t["prompt"] + t["tokens"]
            ids[i, : len(seq)] = torch.tensor(seq)
            p = len(t["prompt"]) - 1
            mask[i, p : p + len(t["tokens"])] = torch.tensor(t["mask"], dtype=torch.float32)
            behav[i, p : p + len(t["tokens"])] = torch.tensor(t["logprobs"])
        logits = self.model(input_ids=ids).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        tok_adv = adv[:, None].expand_as(logp)
        loss, _ = decoupled_ppo_loss(logp, logp.detach(), behav, tok_adv, mask)
        return loss.sum() / mask.sum().clamp(min=1), float(rewards.mean())

    def step(self, trajs, version, allreduce=None):
        loss, reward = self.loss(trajs, version)
        self.opt.zero_grad()
        loss.backward()
        if allreduce is not None:
            allreduce(self.model)
        self.opt.step()
        return reward

    def weights(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def reward_of_row(t) -> float:
    sampled = [x for x, m in zip(t["tokens"], t["mask"]) if m]
    return sum(x < 256 for x in sampled) / max(1, len(sampled))


# ---------------------------------------------------------------------------------------------------- the modes


def sync2_proc(rank, model_dir, seed, steps, port, out_q):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    engine, trainer = make_engine(model_dir), Trainer(model_dir)
    make, ex = prompts_for(seed), ThreadPoolExecutor(16)

    def allreduce(model):
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= 2

    times, rewards, gen = [], [], []
    for step in range(steps):
        began = time.perf_counter()
        groups = [make(step * BATCH + k) for k in range(BATCH)][rank::2]
        trajs, _ = lockstep(engine, groups, sampling_for(seed * 7919 + step * 2 + rank), ex)
        ug = time.perf_counter()
        gen.append(ug - began)  # the rank's lockstep rollout, tool waits included
        rewards.append(trainer.step(pack(trajs), step, allreduce))
        upd = time.perf_counter() - ug
        engine.trainer_stepped()
        engine.ready(lambda: engine.update_weights(trainer.model.state_dict().items()))
        times.append((time.perf_counter() - began, upd, time.perf_counter() - ug - upd))
    out_q.put({"rank": rank, "times": times, "rewards": rewards, "gen": gen})
    dist.destroy_process_group()


def off_rollout(model_dir, seed, steps, to_trainer, weights_q):
    engine, make, ex = make_engine(model_dir), prompts_for(seed), ThreadPoolExecutor(32)
    have = 0
    for step in range(steps):
        while have < max(step - 1, 0):
            have, w = weights_q.get()
            engine.trainer_stepped()
            engine.ready(lambda w=w: engine.update_weights(w.items()))
        began = time.perf_counter()
        groups = [make(step * BATCH + k) for k in range(BATCH)]
        trajs, g = lockstep(engine, groups, sampling_for(seed * 7919 + step), ex)
        to_trainer.put((step, pack(trajs), {"rollout_s": time.perf_counter() - began, "gen_s": g}))


def stream_rollout(model_dir, seed, steps, to_trainer, weights_q, staleness):
    import queue

    from rlctl.algos.admission import Admission
    from rlctl.rollout.streaming import PoolSettings, StreamingPool, versions_per_trajectory

    adm = Admission(BATCH, staleness)
    make = prompts_for(seed)
    pool = StreamingPool(
        make_engine(model_dir),
        adm,
        PoolSettings(N, CHUNK, MAX_RESPONSE, MAX_TURNS, slots=64),
        sampling_for(seed * 7919),
        lambda k: make(k) if k < steps * BATCH + BATCH * (staleness + 1) else None,
        tools=64,
    )
    finished, outstanding, sent, idle, tick_s, began_run = {}, None, 0, 0.0, 0.0, time.perf_counter()
    while sent < steps:
        try:
            version, w = weights_q.get_nowait()
            adm.train(outstanding)
            outstanding = None
            pool.set_weights(version, w.items())
        except queue.Empty:
            pass
        if outstanding is None and (batch := adm.next_batch()) is not None:
            groups = [finished.pop(i) for i in batch]
            trajs = [t for g in groups for t in g.trajectories]
            stale = [adm.version - g.started_at for g in groups]
            meta = {
                "staleness": stale,
                "versions": [versions_per_trajectory(t) for t in trajs],
                "queue": adm.queued,
                "latency": [g.completed_s - g.started_s for g in groups],
                "tool_s": [t.episode.tool_s for t in trajs],
                "calls": [t.episode.calls for t in trajs],
            }
            to_trainer.put((sent, pack(trajs), meta))
            outstanding, sent = batch, sent + 1
            continue
        if not pool.running and not adm.can_start():  # nothing to do until the trainer's weights
            began = time.perf_counter()
            version, w = weights_q.get()
            idle += time.perf_counter() - began
            adm.train(outstanding)
            outstanding = None
            pool.set_weights(version, w.items())
            continue
        t0, ticks = time.perf_counter(), pool.ticks
        for g in pool.step():
            finished[g.index] = g
        if pool.ticks > ticks:
            tick_s += time.perf_counter() - t0
    wall = time.perf_counter() - began_run
    busy = wall - idle - pool.idle_s  # generating, bookkeeping, taking weights: not waiting
    end = {"idle_rollout_s": idle + pool.idle_s, "tick_s": tick_s, "busy_s": busy, "ticks": pool.ticks}
    end["groups_started"] = len(adm.groups)
    to_trainer.put(("end", end))
    pool.close()


def split_trainer(model_dir, steps, from_rollout, weights_q, out_q):
    trainer = Trainer(model_dir)
    times, rewards, metas = [], [], []
    for step in range(steps):
        began = time.perf_counter()
        _, trajs, meta = from_rollout.get()
        waited = time.perf_counter() - began
        rewards.append(trainer.step(trajs, step))
        upd = time.perf_counter() - began - waited
        s0 = time.perf_counter()
        if step + 1 < steps:
            weights_q.put((step + 1, trainer.weights()))
        times.append((time.perf_counter() - began, upd, time.perf_counter() - s0, waited))
        metas.append(meta)
    end = from_rollout.get() if metas and "staleness" in metas[0] else None
    out_q.put({"times": times, "rewards": rewards, "meta": metas, "end": end[1] if end else None})


def run(mode, model_dir, seed, steps, staleness):
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    if mode == "sync2":
        from rlctl.runtime.net import free_port

        port = free_port()
        procs = [ctx.Process(target=sync2_proc, args=(r, model_dir, seed, steps, port, out)) for r in range(2)]
    else:
        to_t, w_q = ctx.Queue(), ctx.Queue()
        roll = (
            ctx.Process(target=off_rollout, args=(model_dir, seed, steps, to_t, w_q))
            if mode == "offpolicy"
            else ctx.Process(target=stream_rollout, args=(model_dir, seed, steps, to_t, w_q, staleness))
        )
        procs = [roll, ctx.Process(target=split_trainer, args=(model_dir, steps, to_t, w_q, out))]
    began = time.perf_counter()
    for p in procs:
        p.start()
    result = out.get()
    if mode == "sync2":  # rank 0's times; the rewards of both halves of the batch
        other = out.get()
        result, other = (result, other) if result["rank"] == 0 else (other, result)
        result["rewards"] = [(a + b) / 2 for a, b in zip(result["rewards"], other["rewards"])]
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    result["wall_s"] = time.perf_counter() - began
    return result


def summarise(mode, r):
    steady = r["times"][WARMUP:]
    step_s = statistics.median(t[0] for t in steady)
    out = {
        "step_s": step_s,  # the median update (what runs 1-3 reported)
        "mean_step_s": statistics.mean(t[0] for t in steady),  # steady wall time per update: throughput
        "throughput": BATCH * N / step_s,
        "reward": statistics.mean(r["rewards"]),
        "rewards": r["rewards"],  # per update: the learning curve
        "U": statistics.median(t[1] for t in steady),
        "S": statistics.median(t[2] for t in steady),
        "U_mean": statistics.mean(t[1] for t in steady),  # the means add up to mean_step_s (since run 4)
        "S_mean": statistics.mean(t[2] for t in steady),
        "step_times": [t[0] for t in r["times"]],  # every update's seconds, warm-up included
    }
    if mode == "sync2":
        out["R"] = statistics.median(r["gen"][WARMUP:])
        out["R_mean"] = statistics.mean(r["gen"][WARMUP:])
    else:
        out["wait"] = statistics.median(t[3] for t in steady)
        if mode == "offpolicy":
            out["R"] = statistics.median(m["rollout_s"] for m in r["meta"][WARMUP:])
            out["R_mean"] = statistics.mean(m["rollout_s"] for m in r["meta"][WARMUP:])
            out["rollout_times"] = [m["rollout_s"] for m in r["meta"]]  # every batch's, warm-up included
            out["gen_s"] = statistics.median(m["gen_s"] for m in r["meta"][WARMUP:])
        else:
            stale = [s for m in r["meta"] for s in m["staleness"]]
            out.update(
                staleness_mean=statistics.mean(stale),
                staleness_max=max(stale),
                versions_per_trajectory=statistics.mean(v for m in r["meta"] for v in m["versions"]),
                idle_trainer_s=sum(t[3] for t in steady) / len(steady),
                group_latency_s=statistics.mean(x for m in r["meta"][WARMUP:] for x in m["latency"]),
                queue_groups=statistics.mean(m["queue"] for m in r["meta"][WARMUP:]),
                latencies=[m["latency"] for m in r["meta"]],  # each update's groups, start to last token
                tool_s=statistics.mean(x for m in r["meta"] for x in m["tool_s"]),  # per trajectory
                calls=statistics.mean(x for m in r["meta"] for x in m["calls"]),
                **(r["end"] or {}),
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--modes", default="sync2,offpolicy,stream")
    ap.add_argument("--out", default=None)
    ap.add_argument("--lr", type=float, default=LR)
    args = ap.parse_args()
    os.environ["AVS_LR"] = str(args.lr)
    from rlctl.testing import build_tiny_model

    model_dir = build_tiny_model(Path(tempfile.mkdtemp(prefix="avs")) / "m", seed=0)
    modes, seeds = args.modes.split(","), [int(s) for s in args.seeds.split(",")]
    rows = []
    for rnd in range(args.rounds):
        seed = seeds[rnd % len(seeds)]
        order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
        for mode in order:
            load = os.getloadavg()[0]
            r = summarise(mode, run(mode, model_dir, seed, args.steps, args.staleness))
            rows.append(
                {"round": rnd, "seed": seed, "mode": mode, "load": load, "steps": args.steps, **r}
                | {"max_staleness": args.staleness}
            )
            print(json.dumps(rows[-1]), flush=True)
    report = analyse(rows, modes)
    print(json.dumps(report, indent=1))
    print_misses(report)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "report": report}, indent=1))


CALLS_PMF = [
    (1 - q) * q**c if c < MAX_TURNS - 1 else q**c for q in [TOOL_CALLS / (1 + TOOL_CALLS)] for c in range(MAX_TURNS)
]  # Tool's geometric number of calls, capped


def stream_latencies(st):
    """The stream runs' group latencies after warm-up (recorded since run 4); for a file that holds only
    each run's mean (runs 1-3), a sample of the workload's model (rlctl.plan.streaming.workload_latencies:
    CALLS_PMF, TOOL_S) whose decode seconds per turn give the measured median of those means."""
    if all("latencies" in r for r in st):
        return tuple(x for r in st for b in r["latencies"][WARMUP:] for x in b), "recorded"
    from rlctl.plan.streaming import turn_s_for, workload_latencies

    mean = statistics.median(r["group_latency_s"] for r in st)
    turn_s = turn_s_for(mean, N, CALLS_PMF, TOOL_S)
    source = f"workload model, {turn_s:.3f} s/turn from the mean {mean:.2f} s"
    return workload_latencies(N, CALLS_PMF, TOOL_S, turn_s), source


def stream_parts(rows):
    """The cost model's inputs from one round's runs, each measured there: the steady means where recorded
    (since run 4), else the medians over updates (runs 1-3)."""
    from rlctl.plan.streaming import StreamParts

    def part(mode, key):
        return statistics.median(r.get(f"{key}_mean", r[key]) for r in rows if r["mode"] == mode)

    st = [r for r in rows if r["mode"] == "stream"]
    lat, source = stream_latencies(st)
    # busy seconds per batch of groups started (recorded since run 4; before, admission's (steps + S) batches)
    started = [r.get("groups_started", (r["steps"] + r["max_staleness"]) * BATCH) / BATCH for r in st]
    return StreamParts(
        # the median batch: the rollout runs one batch ahead, so its first steady batch ran beside the
        # trainer's warm-up and a mean over its batches is not the trainer's steady window's
        lockstep_rollout_s=statistics.median(r["R"] for r in rows if r["mode"] == "offpolicy"),
        stream_generate_s=statistics.median(r["busy_s"] / b for r, b in zip(st, started)),
        update_s=statistics.median(r.get("U_mean", r["U"]) for r in rows if r["mode"] != "sync2"),
        sync_s=statistics.median(r.get("S_mean", r["S"]) for r in rows if r["mode"] != "sync2"),
        dp_update_s=part("sync2", "U") + part("sync2", "S"),  # S: sync2's weight load into its engine
        dp_rollout_s=sync2_rollout(rows),
        group_latencies=lat,
        max_staleness=st[0]["max_staleness"],
        batch=BATCH,
    ), source


def sync2_rollout(rows):
    """sync2's rollout per update, rank 0's (its update includes the all-reduce's wait for rank 1's
    rollout, so per update rollout + update + weight load is the step exactly): the steady mean where
    recorded; runs 1-3 recorded medians, which do not add (rank 0's median update is mostly its own short
    one), so there it is the median step less the median update and load."""
    sync = [r for r in rows if r["mode"] == "sync2"]
    if all("R_mean" in r for r in sync):
        return statistics.median(r["R_mean"] for r in sync)
    return statistics.median(r["step_s"] - r["U"] - r["S"] for r in sync)


def analyse(rows, modes):
    """Medians per mode, and each ratio measured against the cost model's prediction: each round's parts
    predict that round's seconds per update, the medians over rounds give the predicted ratio; measured,
    the ratio of the median updates (``step_s``, all runs) and, where recorded, of the steady means
    (``mean_step_s``: wall time per update, i.e. throughput, since run 4)."""
    from rlctl.plan.streaming import predict_step_s, stream_limits, streaming_decision

    keys = ("step_s", "mean_step_s", "reward", "U", "R")
    med = {}
    for m in modes:
        mine = [r for r in rows if r["mode"] == m]
        med[m] = {k: statistics.median(r[k] for r in mine) for k in keys if all(k in r for r in mine)}
    out = {"medians": med}
    if not {"sync2", "offpolicy", "stream"} <= set(modes):
        return out
    rounds = [stream_parts([r for r in rows if r["round"] == k]) for k in sorted({r["round"] for r in rows})]
    preds = [predict_step_s(p) for p, _ in rounds]
    pred = {m: statistics.median(p[m] for p in preds) for m in ("sync2", "offpolicy", "stream")}
    for a, b in (("stream", "sync2"), ("stream", "offpolicy"), ("offpolicy", "sync2")):
        row = {"predicted": pred[b] / pred[a]}
        for stat in ("mean_step_s", "step_s"):
            if stat in med[a] and stat in med[b]:
                row[f"measured_{stat}"] = med[b][stat] / med[a][stat]
                row[f"miss_{stat}"] = row["predicted"] / row[f"measured_{stat}"] - 1
        out[f"{a}_over_{b}"] = row
    out["predicted_s"] = pred
    parts, source = sorted(rounds, key=lambda ps: predict_step_s(ps[0])["stream"])[(len(rounds) - 1) // 2]
    out["stream_limits"] = stream_limits(parts)  # of the round whose stream prediction is the median
    out["parts"] = {k: v for k, v in parts.__dict__.items() if k != "group_latencies"}
    lat = parts.group_latencies
    out["parts"]["group_latencies"] = f"{len(lat)} ({source}), mean {statistics.fmean(lat):.3f} s"
    out["decision"] = streaming_decision(parts).to_dict()  # what the plan would say from these parts
    return out


def print_misses(report):
    """One line per ratio: predicted, measured (median updates; steady mean where recorded), the miss."""
    for name, r in report.items():
        if isinstance(r, dict) and "predicted" in r:
            got = "; ".join(
                f"measured {r[f'measured_{s}']:.2f}x ({s}), miss {100 * r[f'miss_{s}']:+.0f}%"
                for s in ("mean_step_s", "step_s")
                if f"measured_{s}" in r
            )
            print(f"{name}: predicted {r['predicted']:.2f}x; {got}")


if __name__ == "__main__":
    main()
