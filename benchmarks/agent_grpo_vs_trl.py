"""Seconds per tool-using GRPO step: `rlctl grpo --tools` against TRL 1.16's GRPOTrainer(tools=...), on this CPU.

    python benchmarks/agent_grpo_vs_trl.py [--rounds 3] [--steps 5] [--max-turns 2]

Issue 23's speed criterion: rlctl's step time <= 0.5x TRL's with the same tools, model, data, samples per
prompt and turn limit. Both frameworks get:

* the same model: a tiny Qwen2 (hidden 128, 2 layers, random init, tokenizer trained here) with TRL's own
  copy of the Qwen2.5 chat template (tools rendered as JSON schemas in the system prompt, Hermes
  ``<tool_call>{json}</tool_call>`` calls), fine-tuned first with ``rlctl sft`` on tool traces so that it
  actually calls the tool (a random model never would, and the benchmark would time single-turn GRPO);
* the same tool: ``examples/calculator/calc.py``'s ``calculator`` (rlctl: ``--tools``; TRL: ``tools=``);
* the same data (``What is 37 * 58?``), the same reward (1 when the final assistant message is the
  product), batch (prompts per step), samples per prompt, whole-trajectory response budget (rlctl
  ``--max-response-len``, TRL ``max_completion_length``), turn limit (rlctl ``--max-turns T`` assistant
  turns = TRL ``max_tool_calling_iterations = T - 1`` rounds of tool calls), temperature (0.5), lr, clip 0.2,
  token-mean loss, no KL, one optimizer step per batch, hf rollouts, one process with one thread each.

Runs alternate (rlctl, TRL, rlctl, TRL...) and the ratio is the median over rounds; times are seconds per
step after the first WARMUP_STEPS, by the wall clock and by the training process's CPU time (the tool
calls are trivial: rlctl runs them in worker processes, TRL in the trainer). Each run also records the
tool calls per step it made (rlctl ``tool/calls``, TRL ``tools/call_frequency`` x samples), so a ratio
from runs that made no calls is visible as such.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import grpo_harness as h
from sft_vs_trl import _env

ROOT = Path(__file__).resolve().parent.parent
CALC = ROOT / "examples" / "calculator"
TOOLS = CALC / "calc.py"
REWARD = CALC / "reward.py"


@dataclass(frozen=True)
class Setting:
    hidden: int = 128
    layers: int = 2
    batch: int = 4  # prompts per step
    n: int = 4  # samples per prompt
    response_len: int = 96  # tokens of the whole trajectory (calls, tool messages, answer)
    max_prompt_len: int = 512
    max_turns: int = 2  # assistant turns: a call, then the answer
    temperature: float = 0.5  # sampling temperature of both (a tiny model's calls at 1.0 are mostly malformed)
    sft_traces: int = 512
    sft_steps: int = 120


def _example():
    """examples/calculator/run.py as a module (its problems, tool traces and tool schemas)."""
    spec = importlib.util.spec_from_file_location("calculator_example", CALC / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def build(out: Path, s: Setting) -> tuple[Path, Path]:
    """Tokenizer (Qwen2.5's chat template as TRL ships it), a random tiny Qwen2 fine-tuned on tool traces
    by ``rlctl sft``, and the RL prompts. Returns (model dir, prompts file)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    from rlctl.testing import build_tokenizer

    ex = _example()
    size = ex.QUICK.__class__(**{**asdict(ex.QUICK), "n_sft": s.sft_traces, "n_heldout": 0})
    schemas = ex.tool_schemas()
    train, _ = ex.problems(size, 0)
    traces = [ex.tool_trace(p, schemas) for p in train[: s.sft_traces]]
    probe = build_tokenizer(vocab_size=300)
    probe.chat_template = qwen2_5_chat_template
    corpus = [probe.apply_chat_template(t["messages"], tools=schemas, tokenize=False) for t in traces[:20]] * 5
    tok = build_tokenizer(vocab_size=700, corpus=corpus)
    tok.chat_template = qwen2_5_chat_template
    base = out / "base"
    ex.random_model(base, tok, s.hidden, s.layers, seed=0, max_positions=1024)
    ex._jsonl(out / "sft.jsonl", traces)
    rl = [{"prompt": p.question, "answer": p.answer, "data_source": "calculator"} for p in train[s.sft_traces :]]
    ex._jsonl(out / "rl.jsonl", rl[:256])
    argv = [sys.executable, "-m", "rlctl", "sft", "--model", str(base), "--data", str(out / "sft.jsonl")]
    argv += ["--device", "cpu", "--nproc", "1", "-o", str(out / "sft"), "--max-steps", str(s.sft_steps)]
    argv += ["--batch-size", "16", "--lr", "3e-3", "--max-len", str(s.max_prompt_len), "--seed", "0"]
    with open(out / "sft.log", "w") as log:
        if subprocess.call(argv, env=_env(), stdout=log, stderr=subprocess.STDOUT):
            raise SystemExit(f"rlctl sft failed (log: {out / 'sft.log'})")
    return out / "sft" / "hf", out / "rl.jsonl"


def rlctl_run(args, s: Setting, model: Path, data: Path, out: Path) -> dict:
    argv = h.rlctl_grpo_argv(
        model, data, str(REWARD), out, args.steps, batch=s.batch, n=s.n, temperature=s.temperature,
        max_prompt_len=s.max_prompt_len, response_len=s.response_len,
    )  # fmt: skip
    argv += ["--tools", str(TOOLS), "--max-turns", str(s.max_turns)]
    result, records = h.rlctl_run(argv, out)
    calls = statistics.mean(x.get("tool/calls", 0.0) for x in records)
    turns = statistics.mean(x.get("turns/mean", 0.0) for x in records)
    return {**result, "tool_calls_per_step": calls, "turns_mean": turns}


def trl_run(args, s: Setting, model: Path, data: Path, out: Path) -> dict:
    return h.trl_run(__file__, ["--setting-json", json.dumps(asdict(s))], model, data, out, args.steps)


def trl_worker(args) -> None:
    """One TRL GRPOTrainer run with tools=[calculator] (in its own process); writes OUT/result.json."""
    from datasets import Dataset
    from trl import GRPOTrainer

    sys.path.insert(0, str(CALC))
    from calc import calculator

    s = Setting(**json.loads(args.setting_json))
    out = Path(args.out)
    model, tok = h.trl_model_and_tokenizer(args.model)
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines()]
    ds = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": x["prompt"]}], "answer": x["answer"]} for x in rows]
    )

    def reward(completions, answer, **kwargs):  # the final assistant message must be the product (reward.py)
        scores = []
        for messages, truth in zip(completions, answer):
            last = [m for m in messages if m.get("role") == "assistant"][-1:]
            ok = last and not last[0].get("tool_calls") and (last[0].get("content") or "").strip() == truth
            scores.append(float(bool(ok)))
        return scores

    marks: dict[int, tuple[float, float]] = {}
    rewards: list[float] = []
    calls: list[float] = []
    clock = h.trl_clock(
        marks, rewards, on_logs=lambda logs: calls.append(float(logs.get("tools/call_frequency", 0.0)) * s.batch * s.n)
    )
    config = h.trl_grpo_config(
        out, args.steps, batch=s.batch, n=s.n, response_len=s.response_len, temperature=s.temperature,
        max_tool_calling_iterations=s.max_turns - 1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=ds,
        processing_class=tok,
        tools=[calculator],
        callbacks=[clock],
    )
    trainer.train()
    calls_per_step = statistics.mean(calls) if calls else 0.0
    result = {**h.step_times(marks), "rewards": rewards, "tool_calls_per_step": calls_per_step}
    (out / "result.json").write_text(json.dumps(result))


def _line(fw: str, x: dict) -> str:
    return h.run_line(fw, x, f"{x.get('tool_calls_per_step', 0.0):.1f} calls/step, ")


def summarise(results: dict[str, list[dict]], rounds: int) -> dict:
    med = h.medians(results, ("s_per_step", "cpu_s_per_step", "gain_per_step", "tool_calls_per_step", "load"))
    ratio = h.ratios(med)
    ratio_wall, ratio_cpu = ratio["ratio_wall"], ratio["ratio_cpu"]
    print(
        f"\nmedians over {rounds} rounds: rlctl {med['rlctl']['s_per_step']:.2f} s/step "
        f"(CPU {med['rlctl']['cpu_s_per_step']:.2f}), TRL {med['trl']['s_per_step']:.2f} "
        f"(CPU {med['trl']['cpu_s_per_step']:.2f}): {ratio_wall:.2f}x wall, {ratio_cpu:.2f}x CPU (target <= 0.5x); "
        f"tool calls/step {med['rlctl']['tool_calls_per_step']:.1f} vs {med['trl']['tool_calls_per_step']:.1f}"
    )
    return {**med, **ratio, "target": 0.5}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--max-turns", type=int, default=2)
    ap.add_argument("--out", default="runs/bench-agent-grpo")
    ap.add_argument("--json", default="benchmarks/results/speed/agent-grpo-vs-trl.json")
    ap.add_argument("--keep-model", action="store_true", help="reuse OUT's fine-tuned model from an earlier run")
    h.add_worker_flags(ap, "--setting-json")
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args)
        return

    import shutil

    s = Setting(max_turns=args.max_turns)
    out = Path(args.out)
    if args.keep_model and (out / "sft" / "hf").is_dir():
        model, data = out / "sft" / "hf", out / "rl.jsonl"
    else:
        shutil.rmtree(out, ignore_errors=True)
        model, data = build(out, s)
    results: dict[str, list[dict]] = {"rlctl": [], "trl": []}
    for k in range(args.rounds):
        results["rlctl"].append(rlctl_run(args, s, model, data, out / f"rlctl-{k}"))
        results["trl"].append(trl_run(args, s, model, data, out / f"trl-{k}"))
        print(f"round {k + 1}: " + ", ".join(_line(fw, results[fw][-1]) for fw in ("rlctl", "trl")), flush=True)
    summary = summarise(results, args.rounds)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    doc = {"args": vars(args), "setting": asdict(s), "summary": summary, "runs": results}
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
