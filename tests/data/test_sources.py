"""Every form --data takes: JSONL, Parquet, a directory of Parquet shards, a save_to_disk directory, and a
hub dataset name (offline here: a name that is not cached is one line, exit 2)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from rlctl.data.io import first_rows, looks_like_hub_name, read_rows
from tests.support.cli import run_cli
from tests.support.sft import chat_rows, write_jsonl

ROWS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)]


def test_parquet_shards_directory_reads_every_shard_in_order(tmp_path):
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(ROWS[:4]), shards / "part-000.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[4:7]), shards / "part-001.parquet")
    pq.write_table(pa.Table.from_pylist(ROWS[7:]), shards / "sub" / "part-002.parquet")
    assert read_rows(shards).rows == ROWS
    rows, columns = first_rows(shards, 2)
    assert rows == ROWS[:2] and sorted(columns) == ["answer", "prompt"]


def test_save_to_disk_directory_and_its_splits(tmp_path):
    import datasets

    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:8]), "test": datasets.Dataset.from_list(ROWS[8:])}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert read_rows(tmp_path / "dd").rows == ROWS[:8]
    assert read_rows(tmp_path / "dd", split="test").rows == ROWS[8:]


def test_hub_name_detection(tmp_path):
    assert looks_like_hub_name("openai/gsm8k") and looks_like_hub_name("gsm8k")
    assert (
        not looks_like_hub_name("data/train.jsonl")
        and not looks_like_hub_name("./x")
        and not looks_like_hub_name("a/b/c")
    )


def test_uncached_hub_dataset_is_one_line_through_the_cli(tmp_path, tiny_model_dir):
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    r = run_cli(
        "sft",
        "--model",
        str(tiny_model_dir),
        "--data",
        "nobody/no-such-dataset",
        "--device",
        "cpu",
        "-o",
        str(tmp_path / "run"),
        env=env,
    )
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "nobody/no-such-dataset" in lines[0] and "local cache" in lines[0], r.stderr


def test_empty_directory_is_one_line_through_the_cli(tmp_path, tiny_model_dir):
    (tmp_path / "empty").mkdir()
    r = run_cli("sft", "--model", str(tiny_model_dir), "--data", str(tmp_path / "empty"), "--device", "cpu")
    assert r.returncode == 2 and "no Parquet/JSONL shards" in r.stderr, r.stderr


def test_system_prompt_goes_first_unless_the_row_has_one(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from rlctl.config import build_config
    from rlctl.data.sft import row_tokens

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    row = chat_rows(1)[0]
    plain = build_config("sft", [])
    cfg = build_config("sft", [{"data": {"system_prompt": "Answer in digits."}}])
    ids, mask = row_tokens(row, tok, cfg)
    expected = tok.apply_chat_template(
        [{"role": "system", "content": "Answer in digits."}, *row["messages"]], tokenize=False
    )
    assert tok.decode(ids) == expected
    assert sum(mask) == sum(row_tokens(row, tok, plain)[1])  # the system text is never trained on
    has_system = {"messages": [{"role": "system", "content": "Be brief."}, *row["messages"]]}
    assert row_tokens(has_system, tok, cfg) == row_tokens(has_system, tok, plain)


def test_system_prompt_from_a_file_reaches_the_config(tmp_path):
    (tmp_path / "sys.txt").write_text("You are terse.\n")
    write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    r = run_cli(
        "sft",
        "--model",
        "Qwen2.5-0.5B",
        "--data",
        str(tmp_path / "d.jsonl"),
        "--system-prompt",
        f"@{tmp_path / 'sys.txt'}",
        "--dry-run",
        "--json",
        "-o",
        str(tmp_path / "run"),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["config"]["data"]["system_prompt"] == "You are terse."


def test_chat_template_file_replaces_the_tokenizers(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from rlctl.config import build_config
    from rlctl.data.sft import row_tokens, use_chat_template

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = tmp_path / "template.jinja"
    template.write_text("{{ '#' }}" + tok.chat_template)  # every rendering starts with '#'
    cfg = build_config("sft", [{"data": {"chat_template": str(template)}}])
    row = chat_rows(1)[0]
    ids, mask = row_tokens(row, use_chat_template(tok, cfg), cfg)
    assert tok.decode(ids) == "#" + AutoTokenizer.from_pretrained(tiny_model_dir).apply_chat_template(
        row["messages"], tokenize=False
    )
    assert sum(mask) > 0


def test_missing_chat_template_file_is_one_line_through_the_cli(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    r = run_cli(
        "sft",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data),
        "--device",
        "cpu",
        "--chat-template",
        str(tmp_path / "nope.jinja"),
        "-o",
        str(tmp_path / "run"),
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "chat template file not found" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()
