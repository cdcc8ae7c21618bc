"""A tiny model learns to use a calculator tool, on CPU: SFT on a few hundred tool traces, then GRPO with
``--tools``; the same budget without the tool is the baseline.

``python examples/calculator/run.py [--out runs/calculator] [--nproc 2] [--seed 0] [--quick]``

The task is two-digit multiplication (``What is 37 * 58?`` -> ``2146``), which a 0.6M-parameter model
cannot learn from a few hundred examples, but can learn to hand to a calculator: call
``calculator(expression="37 * 58")``, read ``2146`` in the tool message, answer ``2146``. Both arms
start from the same random model and tokenizer, fine-tune on the same problems for the same number of
steps (with tool traces, or with the bare answers), then run GRPO for the same number of steps with the
same reward (the final assistant message must be the product). Held-out accuracy is measured with plain
transformers (greedy; the tool arm's calls are run by this script, up to two turns).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOOLS = HERE / "calc.py"
REWARD = HERE / "reward.py"
sys.path.insert(0, str(HERE))

from calc import calculator  # noqa: E402


@dataclass(frozen=True)
class Size:
    n_sft: int  # tool traces (and, for the baseline, the same problems with bare answers)
    n_heldout: int
    sft_steps: int
    sft_batch: int
    grpo_steps: int
    grpo_batch: int
    grpo_n: int
    hidden: int
    layers: int


FULL = Size(
    n_sft=400, n_heldout=200, sft_steps=200, sft_batch=32, grpo_steps=20, grpo_batch=16, grpo_n=8, hidden=128, layers=2
)
QUICK = Size(
    n_sft=64, n_heldout=32, sft_steps=100, sft_batch=16, grpo_steps=2, grpo_batch=4, grpo_n=4, hidden=128, layers=2
)
SFT_LR, GRPO_LR = 3e-3, 1e-4
MAX_TURNS = 2  # a call, then the answer
MAX_RESPONSE = 96  # tokens of a whole trajectory (the call, the tool message, the answer: about 60)
MAX_LEN = 192


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} * {self.b}?"

    @property
    def answer(self) -> str:
        return str(self.a * self.b)


def problems(size: Size, seed: int) -> tuple[list[Problem], list[Problem]]:
    """Every ``a * b`` with two-digit operands, shuffled: (training, held out), no overlap."""
    pairs = [Problem(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return pairs[size.n_heldout :], pairs[: size.n_heldout]


def tool_schemas() -> list[dict]:
    """The schemas rlctl derives from calc.py (the SFT traces carry the same ones as the rollouts)."""
    from rlctl.agents.tools import load_agent_spec

    return load_agent_spec(tools=str(TOOLS)).schemas


def tool_trace(p: Problem, schemas: list[dict]) -> dict:
    """An OpenAI-format tool trace: the call (arguments as JSON text), the result, the answer."""
    call = {
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{p.a} * {p.b}"})},
    }
    return {
        "tools": json.dumps(schemas),
        "messages": [
            {"role": "user", "content": p.question},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": calculator(f"{p.a} * {p.b}")},
            {"role": "assistant", "content": p.answer},
        ],
    }


def write_data(out: Path, size: Size, seed: int) -> tuple[list[Problem], list[Problem]]:
    train, heldout = problems(size, seed)
    schemas = tool_schemas()
    sft = train[: size.n_sft]
    rl = [{"prompt": p.question, "answer": p.answer, "data_source": "calculator"} for p in train[size.n_sft :]]
    _jsonl(out / "sft_tool.jsonl", [tool_trace(p, schemas) for p in sft])
    _jsonl(
        out / "sft_plain.jsonl",
        [
            {"messages": [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]}
            for p in sft
        ],
    )
    _jsonl(out / "rl.jsonl", rl)
    return train, heldout


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def build_model(out: Path, size: Size, seed: int) -> int:
    """A tokenizer trained on the task's words and the tool-call text (no digits: every digit is one
    token) with a chat template that renders tools, and a random Qwen2 model."""
    from rlctl.testing import build_tokenizer

    corpus = [
        "What is * ?",
        "user assistant system tool",
        "<tools>calculator</tools>",
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": " * "}}\n</tool_call>',
        "<tool_response>\n\n</tool_response>",
    ] * 20
    tok = build_tokenizer(vocab_size=400, corpus=corpus)
    tok.chat_template = CHAT_TEMPLATE
    model = random_model(out, tok, size.hidden, size.layers, seed, max_positions=256)
    return sum(p.numel() for p in model.parameters())


def random_model(out: Path, tok, hidden: int, layers: int, seed: int, max_positions: int):
    """``tok`` and a random Qwen2 of ``layers`` x ``hidden`` for it (head_dim 64, one kv head), saved to ``out``."""
    from rlctl.testing import save_tiny_model

    return save_tiny_model(
        out,
        tok,
        seed=seed,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
    )


def rlctl(method: str, args: list[str], log) -> None:
    log(f"$ rlctl {method} {' '.join(args)}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = subprocess.call([sys.executable, "-m", "rlctl", method, *args], env=env)
    if code:
        raise SystemExit(f"rlctl {method} failed (exit {code})")


def sft_args(base: Path, data: Path, out: Path, size: Size, nproc: int, seed: int, device: str) -> list[str]:
    return [
        "--model", str(base), "--data", str(data), "--device", device, "--nproc", str(nproc), "-o", str(out),
        "--max-steps", str(size.sft_steps), "--batch-size", str(size.sft_batch), "--lr", str(SFT_LR),
        "--max-len", str(MAX_LEN), "--seed", str(seed),
    ]  # fmt: skip


def grpo_args(
    model: Path, data: Path, out: Path, size: Size, nproc: int, seed: int, tools: bool, device: str
) -> list[str]:
    args = [
        "--model", str(model), "--data", str(data), "--reward", str(REWARD), "--device", device,
        "--nproc", str(nproc), "--rollout", "hf", "-o", str(out), "--max-steps", str(size.grpo_steps),
        "--batch-size", str(size.grpo_batch), "--n", str(size.grpo_n), "--lr", str(GRPO_LR),
        "--temperature", "1.0", "--max-prompt-len", "160", "--max-response-len", str(MAX_RESPONSE if tools else 8),
        "--kl-coef", "0", "--seed", str(seed),
    ]  # fmt: skip
    # rlctl's error texts (Error: Type: message), as this script's own evaluation loop writes them
    agent = ["--tools", str(TOOLS), "--max-turns", str(MAX_TURNS), "--set", "agent.tool_results=rlctl"]
    return args + (agent if tools else [])


# ChatML with Hermes/Qwen tool calls, like Qwen2.5's template, but naming the tools instead of printing
# their JSON schemas: a 0.6M-parameter model reads no JSON, and 100 fewer prompt tokens halve the cost.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def _generate(tok, model, convos: list[list[dict]], schemas: list[dict] | None, max_new: int) -> list[str]:
    import torch

    texts = [tok.apply_chat_template(c, tools=schemas, tokenize=False, add_generation_prompt=True) for c in convos]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=max_new, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
    return tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def final_answers(model_dir: Path, heldout: list[Problem], tools: bool) -> tuple[list[str], int]:
    """Greedy answers (with tools: run the calls, up to MAX_TURNS turns); and how many calls were made."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    schemas = tool_schemas() if tools else None
    convos = [[{"role": "user", "content": p.question}] for p in heldout]
    answers = [""] * len(heldout)
    active, calls = list(range(len(heldout))), 0
    for turn in range(MAX_TURNS if tools else 1):
        if not active:
            break
        texts = _generate(tok, model, [convos[i] for i in active], schemas, MAX_RESPONSE if tools else 8)
        still = []
        for i, text in zip(active, texts):
            found = _CALL.findall(text) if tools else []
            if not found:
                answers[i] = text.strip()
                continue
            if turn == MAX_TURNS - 1:
                continue  # out of turns while calling: no answer
            calls += 1
            convos[i] = convos[i] + _call_messages(text, found[0])
            still.append(i)
        active = still
    return answers, calls


def _call_messages(text: str, payload: str) -> list[dict]:
    try:
        call = json.loads(payload)
        name, args = call["name"], call.get("arguments") or {}
        result = calculator(**args) if name == "calculator" else f"Error: unknown tool {name!r}"
    except Exception as exc:  # noqa: BLE001 (what the rollout does: the error goes back to the model)
        name, args, result = "calculator", {}, f"Error: {type(exc).__name__}: {exc}"
    content = text[: text.find("<tool_call>")].strip()
    call_msg = {"type": "function", "function": {"name": name, "arguments": args if isinstance(args, dict) else {}}}
    return [{"role": "assistant", "content": content, "tool_calls": [call_msg]}, {"role": "tool", "content": result}]


def accuracy(model_dir: Path, heldout: list[Problem], tools: bool) -> tuple[float, int]:
    answers, calls = final_answers(model_dir, heldout, tools)
    return sum(a == p.answer for a, p in zip(answers, heldout)) / len(heldout), calls


def run(out: Path, size: Size, nproc: int, seed: int, device: str = "cpu") -> dict:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    began = time.perf_counter()
    cpu0 = _cpu_seconds()
    base, data = out / "base", out / "data"
    n_params = build_model(base, size, seed)
    train, heldout = write_data(data, size, seed)
    console.print(
        f"Qwen2, {size.layers} layers, hidden {size.hidden}, {n_params / 1e6:.2f}M parameters, random init; "
        f"{size.n_sft} SFT problems, {len(train) - size.n_sft} RL prompts, {len(heldout)} held out"
    )
    results: dict[str, dict] = {}
    for arm, tools in (("calculator tool", True), ("no tool", False)):
        console.rule(f"[bold]{arm}")
        sft_dir, grpo_dir = out / f"{'tool' if tools else 'plain'}_sft", out / f"{'tool' if tools else 'plain'}_grpo"
        sft_data = data / ("sft_tool.jsonl" if tools else "sft_plain.jsonl")
        rlctl("sft", sft_args(base, sft_data, sft_dir, size, nproc, seed, device), console.print)
        after_sft, _ = accuracy(sft_dir / "hf", heldout, tools)
        rlctl(
            "grpo",
            grpo_args(sft_dir / "hf", data / "rl.jsonl", grpo_dir, size, nproc, seed, tools, device),
            console.print,
        )
        after_grpo, calls = accuracy(grpo_dir / "hf", heldout, tools)
        results[arm] = {"after_sft": after_sft, "after_grpo": after_grpo, "calls": calls}
    table = Table(title=f"held-out accuracy ({len(heldout)} two-digit products, greedy)")
    for col in ("", "after SFT", "after GRPO", "calls made"):
        table.add_column(col, justify="right")
    for arm, r in results.items():
        table.add_row(arm, f"{100 * r['after_sft']:.1f}%", f"{100 * r['after_grpo']:.1f}%", str(r["calls"]))
    console.print(table)
    wall, cpu = time.perf_counter() - began, _cpu_seconds() - cpu0
    console.print(f"total time {wall / 60:.1f} min wall, {cpu / 60:.1f} min of CPU (all processes)")
    return {"results": results, "wall_s": wall, "cpu_s": cpu}


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/calculator")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test (accuracies mean nothing)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where rlctl trains (default: cpu)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not (out / "base").exists():
        raise SystemExit(f"{out} exists and was not made by this example; pass another --out")
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    run(out, QUICK if args.quick else FULL, args.nproc, args.seed, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
