"""Seconds per GRPO step and reward gain: `rlctl grpo` against TRL's GRPOTrainer, on this CPU, in three regimes.

    python benchmarks/grpo_vs_trl.py [--regimes overhead,compute,prompt] [--rounds 3] [--steps 8]

Regimes (the issue's): ``overhead``: a tiny Qwen2 (hidden 128, 2 layers), short prompts, 2 prompts x 4
samples x 32 tokens; ``compute``: a ~23M-parameter Qwen2 (hidden 512, 8 layers), short prompts
(~15 tokens), 2 prompts x 8 samples x 64 tokens; ``prompt``: the same model, few-shot prompts of
~180 tokens, 2 prompts x 8 samples x 32 tokens. Models have random weights (rlctl.testing), so the
responses run to the length budget in both frameworks; the reward is :func:`speed_reward.digits`
(the share of digits and spaces in the response: a signal a random model can climb).

Both frameworks run with the same settings: batch (prompts per step), n, response length,
temperature 1, learning rate (constant), PPO clip 0.2, token-mean loss (TRL's ``loss_type="dapo"``),
group-normalised advantages, no KL term and no reference model, one optimizer step per batch, hf
rollouts (``generate``), one process with one thread each, each framework with its defaults
otherwise (rlctl: the plan's; no speed flag). Runs alternate (rlctl, TRL, rlctl, TRL...) and the
ratio is the median over rounds, so a change in the machine's load hits both alike; the load
average is recorded with each run.

Measured as grpo_harness.py says: seconds per step after WARMUP_STEPS by the wall clock and by the
training process's CPU time (robust when other jobs share the machine); reward gain per step: the
least-squares slope of the mean training reward over the steps.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import grpo_harness as h

REWARD = str(Path(__file__).with_name("speed_reward.py")) + ":digits"


@dataclass(frozen=True)
class Regime:
    hidden: int
    layers: int
    batch: int  # prompts per step
    n: int  # samples per prompt
    response_len: int
    shots: int  # solved examples before the question (0: a short prompt)
    max_prompt_len: int


REGIMES = {
    "overhead": Regime(hidden=128, layers=2, batch=2, n=4, response_len=32, shots=0, max_prompt_len=64),
    "compute": Regime(hidden=512, layers=8, batch=2, n=8, response_len=64, shots=0, max_prompt_len=64),
    "prompt": Regime(hidden=512, layers=8, batch=2, n=8, response_len=32, shots=24, max_prompt_len=320),
}


def write_prompts(path: Path, shots: int, count: int = 64, seed: int = 0) -> Path:
    """Addition questions, each after ``shots`` solved ones (few-shot prompts share no text but the format)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        solved = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(shots)]
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        text = "".join(f"{x} + {y} = {x + y}. " for x, y in solved) + f"What is {a} + {b}?"
        rows.append({"prompt": text, "answer": str(a + b)})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rlctl_run(args, r: Regime, model: Path, data: Path, out: Path) -> dict:
    argv = h.rlctl_grpo_argv(
        model, data, REWARD, out, args.steps, batch=r.batch, n=r.n, temperature=1.0,
        max_prompt_len=r.max_prompt_len, response_len=r.response_len,
    )  # fmt: skip
    return h.rlctl_run(argv, out)[0]


def trl_run(args, r: Regime, model: Path, data: Path, out: Path) -> dict:
    return h.trl_run(__file__, ["--regime-json", json.dumps(asdict(r))], model, data, out, args.steps)


def trl_worker(args) -> None:
    """One TRL GRPOTrainer run (in its own process); writes OUT/result.json."""
    from datasets import Dataset
    from speed_reward import digits
    from trl import GRPOTrainer

    r = Regime(**json.loads(args.regime_json))
    out = Path(args.out)
    model, tok = h.trl_model_and_tokenizer(args.model)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": x["prompt"]}]} for x in rows])

    def reward(completions, **kwargs):
        return [digits("", c[0]["content"], None) for c in completions]

    marks: dict[int, tuple[float, float]] = {}
    rewards: list[float] = []
    clock = h.trl_clock(marks, rewards)
    config = h.trl_grpo_config(out, args.steps, batch=r.batch, n=r.n, response_len=r.response_len, temperature=1.0)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=ds, processing_class=tok, callbacks=[clock]
    )
    trainer.train()
    (out / "result.json").write_text(json.dumps({**h.step_times(marks), "rewards": rewards}))


def build_models(out: Path, names: list[str]) -> dict[str, tuple[Path, Path]]:
    from rlctl.testing import build_tiny_model

    built = {}
    for name in names:
        r = REGIMES[name]
        model = build_tiny_model(
            out / f"model-{r.hidden}x{r.layers}",
            seed=0,
            hidden_size=r.hidden,
            intermediate_size=3 * r.hidden,
            num_attention_heads=r.hidden // 64,
            num_key_value_heads=max(1, r.hidden // 256),
            num_hidden_layers=r.layers,
            max_position_embeddings=512,
        )
        built[name] = (model, write_prompts(out / f"prompts-{r.shots}.jsonl", r.shots))
    return built


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--regimes", default="overhead,compute,prompt")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="runs/bench-grpo")
    ap.add_argument("--json", default="benchmarks/results/speed/grpo-vs-trl.json")
    h.add_worker_flags(ap, "--regime-json")
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return

    import shutil

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    names = args.regimes.split(",")
    built = build_models(out, names)
    results: dict[str, dict[str, list[dict]]] = {}
    for name in names:
        r, (model, data) = REGIMES[name], built[name]
        results[name] = {"rlctl": [], "trl": []}
        for k in range(args.rounds):
            results[name]["rlctl"].append(rlctl_run(args, r, model, data, out / f"{name}-rlctl-{k}"))
            results[name]["trl"].append(trl_run(args, r, model, data, out / f"{name}-trl-{k}"))
            line = ", ".join(h.run_line(fw, results[name][fw][-1]) for fw in ("rlctl", "trl"))
            print(f"{name} round {k + 1}: {line}", flush=True)
    print(f"\nmedians over {args.rounds} rounds (one process, one thread each, hf rollouts):")
    summary = {}
    for name in names:
        med = h.medians(results[name], ("s_per_step", "cpu_s_per_step", "gain_per_step", "load"))
        target = 0.8 if name == "compute" else 0.5
        ratio = h.ratios(med)
        ratio_wall, ratio_cpu = ratio["ratio_wall"], ratio["ratio_cpu"]
        summary[name] = {**med, **ratio, "target": target}
        print(
            f"  {name:8s} rlctl {med['rlctl']['s_per_step']:.2f} s/step (CPU {med['rlctl']['cpu_s_per_step']:.2f}), "
            f"TRL {med['trl']['s_per_step']:.2f} (CPU {med['trl']['cpu_s_per_step']:.2f}): {ratio_wall:.2f}x wall, "
            f"{ratio_cpu:.2f}x CPU (target <= {target}x); reward gain/step {med['rlctl']['gain_per_step']:+.4f} "
            f"vs {med['trl']['gain_per_step']:+.4f}"
        )
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    regimes = {n: asdict(REGIMES[n]) for n in names}
    Path(args.json).write_text(
        json.dumps({"args": vars(args), "regimes": regimes, "summary": summary, "runs": results}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
