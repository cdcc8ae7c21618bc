"""Messages name what the user typed and list what exists (issue 37, item 9). The CLI in process; the
model directories are real (the tiny text and vision-language models) under names like the ones users give
(`./out/hf`, `runs/x/base`), so a message naming only the last component ("hf", "base") cannot pass."""

from __future__ import annotations

import os
import shutil

import pytest

from tests.support.cli import one_line_error, rlctl_in_process
from tests.support.rl import arith_rows
from tests.support.sft import write_jsonl

RL = ("--max-prompt-len", "48", "--max-response-len", "12", "--device", "cpu")


@pytest.fixture
def data(tmp_path):
    return write_jsonl(tmp_path / "rl.jsonl", arith_rows(8))


def test_a_vision_language_model_is_named_by_the_path_typed(monkeypatch, capsys, tiny_vl_model_dir, data, tmp_path):
    shutil.copytree(tiny_vl_model_dir, tmp_path / "out" / "hf")
    monkeypatch.chdir(tmp_path)
    args = ["grpo", "--model", "./out/hf", "--data", str(data), "--reward", "exact", *RL, "--nproc", "2"]
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args, "--sp", "2", "--dry-run"))
    assert "./out/hf is a vision-language model" in line, line


def test_a_text_model_is_named_by_the_path_typed(monkeypatch, capsys, tiny_model_dir, data, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path / "runs" / "x" / "base")
    monkeypatch.chdir(tmp_path)
    args = ["grpo", "--model", "runs/x/base", "--data", str(data), "--reward", "exact", *RL, "--nproc", "2"]
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args, "--sp", "3", "--dry-run"))
    assert "(runs/x/base on 2 ranks)" in line, line


def test_a_missing_reward_function_lists_the_files_functions(monkeypatch, capsys, tiny_model_dir, data, tmp_path):
    (tmp_path / "my_reward.py").write_text(
        "def score(*a, **k):\n    return 1.0\n\ndef bonus(*a, **k):\n    return 0.0\n"
    )
    args = ["grpo", "--model", str(tiny_model_dir), "--data", str(data), *RL]
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args, "--reward", f"{tmp_path}/my_reward.py:nope"))
    assert "no function 'nope' (it has: bonus, score)" in line, line


def test_a_missing_environment_class_lists_the_files_classes(monkeypatch, capsys, tiny_model_dir, data, tmp_path):
    (tmp_path / "envs.py").write_text("class Maze:\n    def reset(self, **kw):\n        return ''\n")
    args = ["grpo", "--model", str(tiny_model_dir), "--data", str(data), "--reward", "exact", *RL]
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args, "--env", f"{tmp_path}/envs.py:NoSuchClass"))
    assert "no class 'NoSuchClass' (it has: Maze)" in line, line
    assert os.path.isfile(tmp_path / "envs.py")
