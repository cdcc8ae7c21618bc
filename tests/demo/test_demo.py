"""The demo: the arithmetic task's generator, its accuracy function, and `python -m rlctl.demo --quick`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.data import arith
from rlctl.errors import UserError

REPO = Path(__file__).resolve().parents[2]
QUESTION = re.compile(r"^What is (\d+) \+ (\d+)\?$")


def operands(question: str) -> tuple[int, int]:
    m = QUESTION.match(question)
    assert m, question
    return int(m.group(1)), int(m.group(2))


# ---------------------------------------------------------------------------------------------
# The generator


def test_split_covers_every_pair_once_without_overlap():
    train, heldout = arith.make_problems(9, 30, seed=3)
    assert len(heldout) == 30 and len(train) == 70
    train_q = {p.question for p in train}
    held_q = {p.question for p in heldout}
    assert not train_q & held_q
    assert train_q | held_q == {f"What is {a} + {b}?" for a in range(10) for b in range(10)}


def test_split_is_deterministic_and_depends_on_the_seed():
    assert arith.make_problems(19, 50, seed=0) == arith.make_problems(19, 50, seed=0)
    assert arith.make_problems(19, 50, seed=0)[1] != arith.make_problems(19, 50, seed=1)[1]
    with pytest.raises(ValueError):
        arith.make_problems(3, 16)


def test_answers_are_the_sums():
    train, heldout = arith.make_problems(49, 100)
    for p in train + heldout:
        a, b = operands(p.question)
        assert int(p.answer) == a + b
        assert p.carries == (a % 10 + b % 10 > 9)
    assert arith.Problem(15, 27).slip == "32" and arith.Problem(15, 23).slip == "38"


def test_rows_in_the_formats_rlctl_reads(tmp_path):
    problems = [arith.Problem(12, 7), arith.Problem(15, 27)]
    sft = arith.sft_rows(problems)
    assert sft[1] == {
        "messages": [{"role": "user", "content": "What is 15 + 27?"}, {"role": "assistant", "content": "42"}]
    }
    rl = arith.rl_rows(problems)
    assert rl[0] == {"prompt": "What is 12 + 7?", "answer": "19", "data_source": "arith"}
    path = arith.write_jsonl(rl, tmp_path / "d" / "rl.jsonl")
    assert [json.loads(line) for line in path.read_text().splitlines()] == rl


def test_sloppy_teacher_forgets_only_carries():
    train, _ = arith.make_problems(49, 100)
    assert arith.teacher_answers(train, slip_rate=0.0) == [p.answer for p in train]
    always = arith.teacher_answers(train, slip_rate=1.0)
    for p, ans in zip(train, always):
        a, b = operands(p.question)
        assert int(ans) == (a + b - 10 if (a % 10 + b % 10) >= 10 else a + b)
    some = arith.teacher_answers(train, slip_rate=0.7, seed=5)
    assert some == arith.teacher_answers(train, slip_rate=0.7, seed=5)
    carrying = [ans != p.answer for p, ans in zip(train, some) if p.carries]
    assert all(ans == p.answer for p, ans in zip(train, some) if not p.carries)
    assert 0.6 < sum(carrying) / len(carrying) < 0.8


def test_tokenizer_keeps_digits_apart(tmp_path):
    from rlctl.testing import build_tokenizer

    tok = build_tokenizer(tmp_path, vocab_size=320, corpus=arith.tokenizer_corpus())
    ids = tok("What is 12 + 70?", add_special_tokens=False)["input_ids"]
    digits = [t for t in tok.convert_ids_to_tokens(ids) if any(c.isdigit() for c in t)]
    assert digits == ["1", "2", "7", "0"]


def test_rlctl_reads_the_rows_and_the_exact_reward_accepts_the_answers(tmp_path):
    """The files go through rlctl's own readers: SFT loss only on the answer and the end of turn, RL
    prompts that end with the generation prompt and carry the answer as ground truth."""
    from rlctl.config import build_config
    from rlctl.data.rl import build_rl_data
    from rlctl.data.sft import IGNORE, build_sft_data
    from rlctl.rewards.builtin import exact_score
    from rlctl.testing import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok", vocab_size=320, corpus=arith.tokenizer_corpus())
    problems = [arith.Problem(12, 7), arith.Problem(40, 9)]
    sft_path = arith.write_jsonl(arith.sft_rows(problems), tmp_path / "sft.jsonl")
    rl_path = arith.write_jsonl(arith.rl_rows(problems), tmp_path / "rl.jsonl")
    sft = build_sft_data(build_config("sft", [{"data": {"path": str(sft_path)}, "train": {"max_len": 64}}]), tok)
    targets = [tok.decode([t for t in ex.labels.tolist() if t != IGNORE]) for ex in sft.train]
    assert targets == ["19<|im_end|>\n", "49<|im_end|>\n"]  # the turn ends with the template's marker
    rl = build_rl_data(build_config("grpo", [{"data": {"path": str(rl_path)}}]), tok)
    assert [p.ground_truth for p in rl.train] == ["19", "49"]
    assert tok.decode(rl.train[0].token_ids).endswith("What is 12 + 7?<|im_end|>\n<|im_start|>assistant\n")
    assert exact_score("arith", "19", "19") == 1.0 and exact_score("arith", "91", "19") == 0.0


# ---------------------------------------------------------------------------------------------
# Evaluation through plain transformers


@pytest.fixture(scope="module")
def random_model(tmp_path_factory) -> Path:
    from rlctl.demo import QUICK, build_model

    out = tmp_path_factory.mktemp("demo") / "base"
    build_model(out, QUICK)
    return out


def test_batched_greedy_answers_match_a_one_by_one_decode(random_model):
    """generate_answers (left-padded batches) against a hand-written greedy loop, one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(random_model))
    model = AutoModelForCausalLM.from_pretrained(str(random_model)).eval()
    problems = [arith.Problem(a, b) for a, b in [(3, 4), (12, 7), (40, 49), (9, 1), (25, 25)]]
    expected = []
    for p in problems:
        text = tok.apply_chat_template(
            [{"role": "user", "content": p.question}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        new: list[int] = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
                new.append(nxt)
                if nxt == tok.eos_token_id:
                    break
        expected.append(tok.decode(new, skip_special_tokens=True).strip())
    assert arith.generate_answers(random_model, problems, batch_size=3) == expected


def test_accuracy_is_the_share_of_exact_answers(monkeypatch, random_model):
    problems = [arith.Problem(1, 2), arith.Problem(5, 5), arith.Problem(20, 22), arith.Problem(7, 0)]
    monkeypatch.setattr(arith, "generate_answers", lambda *a, **k: ["3", "10", "24", " 7"])
    assert arith.accuracy(random_model, problems) == 0.5  # "24" is wrong, " 7" is not exactly "7"
    with pytest.raises(ValueError):
        arith.accuracy(random_model, [])


def test_out_dir_is_replaced_only_when_the_demo_made_it(tmp_path):
    from rlctl.demo import MARKER, prepare_out

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(UserError):
        prepare_out(mine)
    assert (mine / "notes.txt").exists()
    demo = tmp_path / "demo"
    prepare_out(demo)
    (demo / "old.txt").write_text("x")
    prepare_out(demo)
    assert sorted(p.name for p in demo.iterdir()) == [MARKER]


# ---------------------------------------------------------------------------------------------
# The whole demo


@pytest.mark.slow
def test_quick_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "rlctl.demo", "--quick", "--out", str(out)],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert re.search(r"after SFT: \d+\.\d% of the held-out problems right", text), text[-2000:]
    m = re.search(r"held-out accuracy: (\d+\.\d)% -> (\d+\.\d)%", text)
    assert m, text[-2000:]
    assert re.search(r"What is \d+ \+ \d+\? -> .* \(true answer \d+\)", text)
    hf = out / "grpo" / "hf"
    assert (hf / "config.json").exists() and list(hf.glob("*.safetensors"))
    assert json.loads((out / "grpo" / "summary.json").read_text())["status"] == "completed"
    # the exported model's held-out accuracy, recomputed here, is the one the demo printed
    from rlctl.demo import QUICK, SEED

    _, heldout = arith.make_problems(QUICK.max_operand, QUICK.n_heldout, seed=SEED)
    assert abs(100 * arith.accuracy(hf, heldout) - float(m.group(2))) < 0.06
    # rlctl's own eval (--val-data, --eval-before) measured the same held-out accuracy at step 0 and at the end
    evals = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e.get("kind") == "eval"]
    assert [e["step"] for e in evals][0] == 0 and len(evals) == 2
    assert abs(100 * evals[0]["val/acc"] - float(m.group(1))) < 2.5, (evals, m.group(0))
    assert abs(100 * evals[-1]["val/acc"] - float(m.group(2))) < 2.5, (evals, m.group(0))
    page = out / "grpo" / "report.html"
    assert (
        page.is_file() and f"report (every curve, held-out accuracy at step 0 and at the end, rollouts): {page}" in text
    )
