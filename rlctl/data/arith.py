"""The demo's built-in task: integer addition, generated offline and scored by exact match.

A problem is ``What is 12 + 7?`` with the answer ``19``. :func:`make_problems` enumerates every pair
of operands in a range, shuffles them with a fixed seed and splits them into a training set and a
held-out set that share no problem (``a + b`` and ``b + a`` are different problems and may fall on
different sides). The rows are written in the two formats rlctl reads:

* SFT chat rows ``{"messages": [{"role": "user", ...}, {"role": "assistant", "content": "19"}]}``
* RL rows ``{"prompt": "What is 12 + 7?", "answer": "19", "data_source": "arith"}`` (``--reward exact``)

:func:`teacher_answers` gives imperfect demonstrations, a teacher who sometimes forgets to carry
(``15 + 27 = 32``): the demo fine-tunes on them, then lets GRPO's exact-match reward correct the habit.
:func:`accuracy` is the held-out evaluation: greedy decoding through plain transformers
(``AutoModelForCausalLM.from_pretrained`` + ``generate``), the share of answers that are exactly right.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "arith"


@dataclass(frozen=True)
class Problem:
    """``a + b``."""

    a: int
    b: int

    @property
    def question(self) -> str:
        return f"What is {self.a} + {self.b}?"

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def carries(self) -> bool:
        """Whether the units digits carry into the tens."""
        return self.a % 10 + self.b % 10 >= 10

    @property
    def slip(self) -> str:
        """The answer with the carry forgotten (``15 + 27`` -> ``32``); the right answer when nothing carries."""
        return str(self.a + self.b - 10 * self.carries)


def make_problems(max_operand: int, n_heldout: int, *, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """Every ``a + b`` with ``0 <= a, b <= max_operand``, shuffled by ``seed``: (train, held-out).

    The first ``n_heldout`` problems of the shuffled list are held out; the rest are for training.
    """
    pairs = [Problem(a, b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    if not 0 < n_heldout < len(pairs):
        raise ValueError(f"n_heldout must be between 1 and {len(pairs) - 1}, got {n_heldout}")
    random.Random(seed).shuffle(pairs)
    return pairs[n_heldout:], pairs[:n_heldout]


def teacher_answers(problems: Iterable[Problem], *, slip_rate: float = 0.0, seed: int = 0) -> list[str]:
    """A sloppy teacher's answers: on each problem that carries, the carry is forgotten with
    probability ``slip_rate`` (drawn with ``seed``); every other answer is right."""
    rng = random.Random(seed)
    return [p.slip if p.carries and rng.random() < slip_rate else p.answer for p in problems]


def sft_rows(problems: Iterable[Problem], answers: Iterable[str] | None = None) -> list[dict]:
    """Chat rows for ``rlctl sft``: the question as the user turn, the bare answer (``answers``,
    default the right ones) as the assistant's."""
    problems = list(problems)
    answers = [p.answer for p in problems] if answers is None else list(answers)
    return [
        {"messages": [{"role": "user", "content": p.question}, {"role": "assistant", "content": a}]}
        for p, a in zip(problems, answers, strict=True)
    ]


def rl_rows(problems: Iterable[Problem]) -> list[dict]:
    """Prompt rows for ``rlctl grpo --reward exact``."""
    return [{"prompt": p.question, "answer": p.answer, "data_source": DATA_SOURCE} for p in problems]


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tokenizer_corpus() -> list[str]:
    """Text for training the demo's tokenizer: the task's words and no digits at all, so no merge
    joins two digits and every number is tokenized digit by digit."""
    return ["What is + ?", "user assistant system", "What is the answer ?"] * 10


def generate_answers(
    model_dir: str | Path, problems: list[Problem], *, batch_size: int = 256, max_new_tokens: int = 6
) -> list[str]:
    """Greedy answers of the HF model in ``model_dir`` (special tokens dropped, whitespace stripped)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    answers: list[str] = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p.question}], tokenize=False, add_generation_prompt=True
            )
            for p in chunk
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        answers += [t.strip() for t in tok.batch_decode(new, skip_special_tokens=True)]
    return answers


def accuracy(model_dir: str | Path, problems: list[Problem], **kwargs) -> float:
    """Share of ``problems`` whose greedy answer is exactly right (0.0 to 1.0)."""
    if not problems:
        raise ValueError("accuracy needs at least one problem")
    answers = generate_answers(model_dir, problems, **kwargs)
    return sum(a == p.answer for a, p in zip(answers, problems)) / len(problems)
