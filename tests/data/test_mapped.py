"""Tokenization through datasets.map: cached in the run directory, done once (rank 0), equal to the
plain per-row result."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from rlctl.data.mapped import map_rows
from tests.support.cli import REPO, torchrun
from tests.support.sft import chat_rows, write_jsonl

FEATURES = {"ids": "int32 list", "bad": "string"}


def test_map_rows_caches_and_a_second_call_does_not_run_the_function(tmp_path):
    rows = [{"x": i} for i in range(300)]  # more than one batch of 256
    first = map_rows(
        rows,
        lambda r: {"ids": [r["x"]] * (r["x"] % 4), "bad": ""},
        cache_dir=tmp_path,
        key="a",
        desc="t",
        features=FEATURES,
    )
    assert first == [{"ids": [i] * (i % 4), "bad": ""} for i in range(300)]
    assert (tmp_path / "t-a.arrow").is_file()

    def boom(row):
        raise AssertionError("the cache was not used")

    assert map_rows(rows, boom, cache_dir=tmp_path, key="a", desc="t", features=FEATURES) == first


def test_sft_data_through_the_cache_equals_the_plain_path_and_a_changed_file_is_retokenized(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from rlctl.config import build_config
    from rlctl.data.sft import build_sft_data

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(12) + [{"messages": "not a list"}])
    cfg = build_config("sft", [{"data": {"path": str(data)}, "train": {"max_len": 96}}])
    plain = build_sft_data(cfg, tok)
    cached = build_sft_data(cfg, tok, cache_dir=tmp_path / "cache")
    assert len(cached.train) == len(plain.train) == 12 and cached.report.to_dict() == plain.report.to_dict()
    for a, b in zip(cached.train, plain.train):
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.labels.tolist() == b.labels.tolist()
    write_jsonl(data, chat_rows(5))  # new contents: a new cache key
    assert len(build_sft_data(cfg, tok, cache_dir=tmp_path / "cache").train) == 5
    assert len(list((tmp_path / "cache").glob("sft-*.arrow"))) == 2


def test_under_torchrun_only_rank_0_tokenizes(tmp_path):
    script = Path(__file__).parent / "map_once_script.py"
    cmd = torchrun(2, script, tmp_path)
    with open(tmp_path / "torchrun.log", "w") as log:
        r = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=120)
    assert r.returncode == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    ranks = [json.loads((tmp_path / f"rank_{i}.json").read_text()) for i in range(2)]
    assert ranks[0]["calls"] == 50 and ranks[1]["calls"] == 0
    want = [{"ids": [i, 2 * i], "bad": "" if i % 3 else "multiple of 3"} for i in range(50)]
    assert ranks[0]["got"] == ranks[1]["got"] == want
