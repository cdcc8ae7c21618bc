"""`rlctl bench`: every subcommand on the tiny model on CPU (well-formed JSON with the documented
fields), the FLOP arithmetic against a hand-worked case, and the estimator-vs-measured comparison
checked from the JSON's own numbers and a real process."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from rlctl.catalog.spec import ModelSpec
from tests.support.cli import REPO, run_cli

ENVELOPE = {"kind", "command", "date", "machine", "settings", "results"}


def bench_json(*args: str, timeout: int = 900) -> dict:
    res = run_cli("bench", *args, "--json", timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(res.stdout)
    assert ENVELOPE <= set(doc)
    assert doc["command"].startswith("rlctl bench " + args[0])
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu"] and doc["date"][:2] == "20"
    return doc


def rendered(doc: dict) -> str:
    """The tables `rlctl bench` prints without --json."""
    from rich.console import Console

    from rlctl.bench.tables import render

    console = Console(record=True, width=200)
    render(doc, console)
    return console.export_text()


# ---------------------------------------------------------------------------------------------
# FLOPs and MFU, by hand


TINY = ModelSpec(
    name="t",
    hf_id="t",
    arch="qwen2",
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=64,
    vocab_size=512,
    qkv_bias=True,
)


def test_flops_per_token_worked_by_hand():
    from rlctl.bench.mfu import (
        flops_params,
        forward_flops_per_token,
        mfu,
        train_flops_per_token,
    )

    # One layer: q 128x128, k and v 128x64 each, o 128x128 = 49152; q/k/v biases 128+64+64 = 256;
    # gate/up/down 3x128x256 = 98304; two RMSNorms 256. Total 147968.
    layer = 49152 + 256 + 98304 + 256
    # N: 2 layers + final norm 128 + lm_head 512x128; the input embedding is a lookup, not counted.
    assert flops_params(TINY) == 2 * layer + 128 + 65536 == 361600
    # Tied embeddings: the lm_head matmul still runs, so N is the same.
    assert flops_params(replace(TINY, tie_embeddings=True)) == 361600
    # Forward at s = 100: 2N + 2 * L * s * (d_qk + d_v) = 723200 + 2*2*100*(128+128) = 723200 + 102400.
    assert forward_flops_per_token(TINY, 100) == 825600
    # Training = 3 x forward = 6N + 12 * L * s * heads * head_dim (PaLM) = 2169600 + 307200.
    assert train_flops_per_token(TINY, 100) == 2476800
    # 1000 such tokens in 2 s on a 1 GFLOP/s device.
    assert mfu(2476800 * 1000, 2.0, 1e9) == pytest.approx(1.2384)


def test_step_flops_count_the_old_logprob_pass_only_where_it_runs():
    """GRPO and PPO with one optimizer step per batch and no KL skip the actor's old-log-prob pass; PPO's
    values pass still records time/logprobs, which must not bring the actor's pass back into the count."""
    from rlctl.bench.mfu import flops_params, forward_flops_per_token
    from rlctl.bench.train import critic_flops_params, step_flops
    from rlctl.config import build_config

    record = {"tokens": 400, "time/logprobs": 0.1}  # 4 sequences of 100 tokens
    fwd = 400 * forward_flops_per_token(TINY, 100)
    critic = fwd * critic_flops_params(TINY) / flops_params(TINY)

    def logprob_flops(method: str, **algo) -> float:
        cfg = build_config(method, [{"algo": {"kl_coef": 0.0, **algo}, "train": {"batch_size": 4}}])
        return step_flops(TINY, cfg, record, 4)["logprobs"]

    assert logprob_flops("grpo") == 0.0
    assert logprob_flops("grpo", kl_coef=0.01) == pytest.approx(2 * fwd)  # the actor's and the reference's
    assert logprob_flops("grpo", ppo_epochs=2) == pytest.approx(fwd)
    assert logprob_flops("grpo", mini_batch_size=2) == pytest.approx(fwd)
    assert logprob_flops("ppo") == pytest.approx(critic)  # the values pass only
    assert logprob_flops("ppo", ppo_epochs=2) == pytest.approx(fwd + critic)


def test_flops_params_matches_a_real_model(tiny_model_dir):
    """N equals transformers' own parameter count less the input embedding."""
    from transformers import AutoModelForCausalLM

    from rlctl.bench.mfu import flops_params
    from rlctl.catalog import resolve_model

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    real = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert flops_params(resolve_model(str(tiny_model_dir))) == real


def test_relative_error_sign():
    from rlctl.bench.common import relative_error

    assert relative_error(200, 150) == 0.25  # the estimate is 25% too low
    assert relative_error(100, 150) == -0.5


# ---------------------------------------------------------------------------------------------
# Models


def test_catalog_model_needs_random_init_and_builds_from_the_catalog(tmp_path, monkeypatch):
    from rlctl.bench.models import resolve_bench_model
    from rlctl.catalog import hf_config_dict, resolve_model
    from rlctl.errors import UserError

    monkeypatch.setenv("RLCTL_CACHE_DIR", str(tmp_path))
    with pytest.raises(UserError, match="--random-init"):
        resolve_bench_model("Qwen2.5-0.5B")
    m = resolve_bench_model("Qwen2.5-0.5B", random_init=True, need_weights=False)
    assert m.random_init and not list(m.path.glob("*.safetensors"))  # training builds the weights in memory
    config = json.loads((m.path / "config.json").read_text())
    expected = hf_config_dict(resolve_model("Qwen2.5-0.5B"))
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")} == {
        k: expected[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")
    }
    assert (m.path / "tokenizer.json").is_file()


def test_tiny_is_built_once_into_the_cache(tmp_path, monkeypatch):
    from rlctl.bench.models import resolve_bench_model

    monkeypatch.setenv("RLCTL_CACHE_DIR", str(tmp_path))
    first = resolve_bench_model("tiny")
    stamp = (first.path / "config.json").stat().st_mtime_ns
    again = resolve_bench_model("tiny")
    assert again.path == first.path and (again.path / "config.json").stat().st_mtime_ns == stamp
    assert list(first.path.glob("*.safetensors")) and first.spec.num_layers == 2


# ---------------------------------------------------------------------------------------------
# bench rollout


def _bench_rollout(model, engines: str, *, reps: int) -> dict:
    """`rlctl bench rollout --json` of ``engines`` on the CPU: 2 prompts of about 8 tokens, 2 samples of at most 4
    tokens each."""
    return bench_json(
        "rollout", "--model", str(model), "--engine", engines, "--prompts", "2", "--n", "2", "--prompt-len", "8",
        "--max-tokens", "4", "--reps", str(reps), "--device", "cpu",
    )  # fmt: skip


@pytest.fixture(scope="module")
def rollout_doc(tiny_model_dir) -> dict:
    """hf engine, plus sglang which cannot start here: its row carries the error."""
    return _bench_rollout(tiny_model_dir, "hf,sglang", reps=2)


def test_rollout_json(rollout_doc):
    assert rollout_doc["kind"] == "rollout"
    hf, sglang = rollout_doc["results"]
    assert sglang["engine"] == "sglang" and sglang["error"]
    assert hf["engine"] == "hf" and hf["error"] is None
    assert hf["samples"] == 4 and 4 <= hf["generated_tokens"] <= 16
    for key in ("tokens_per_s", "tokens_per_s_distinct", "ttft_s", "load_s"):
        assert hf[key] > 0, key
    assert hf["shared_prefix_speedup"] == pytest.approx(hf["tokens_per_s"] / hf["tokens_per_s_distinct"])
    # every repetition of every case was timed, and tokens/s is the median of tokens / seconds
    runs = hf["runs"]
    assert {len(v) for v in runs.values()} == {2} and set(runs) == {"shared", "distinct", "first_token"}
    rates = sorted(r["tokens"] / r["seconds"] for r in runs["shared"])
    assert hf["tokens_per_s"] == pytest.approx(sum(rates) / 2)
    assert all(r["tokens"] == r["samples"] == 4 for r in runs["first_token"])  # max_tokens=1
    mem = hf["memory"]  # from the worker process: peak RSS above its RSS before the engine
    assert mem["peak_bytes"] == hf["peak_memory_bytes"] == mem["process_peak_bytes"] - mem["baseline_bytes"] > 0
    assert mem["baseline_bytes"] > 100 * 2**20  # a python process with torch and transformers loaded
    text = rendered(rollout_doc)
    assert f"{hf['tokens_per_s']:,.1f}" in text and "sglang: " in text


@pytest.mark.slow
def test_rollout_hf_and_vllm_in_one_table(tiny_model_dir):
    doc = _bench_rollout(tiny_model_dir, "hf,vllm", reps=1)
    rows = {r["engine"]: r for r in doc["results"]}
    assert set(rows) == {"hf", "vllm"} and not any(r["error"] for r in rows.values())
    assert rows["vllm"]["tokens_per_s"] > 0 and rows["vllm"]["peak_memory_bytes"] > rows["hf"]["peak_memory_bytes"]


def test_plot_writes_a_png_or_says_what_is_missing(rollout_doc, tmp_path, monkeypatch):
    from rlctl.bench.plot import bars, plot
    from rlctl.errors import UserError

    unit, speed, memory = bars(rollout_doc)
    assert unit == "generated tokens/s" and set(speed) == {"hf n=2", "hf n=1"} and set(memory) == {"hf"}
    if importlib.util.find_spec("matplotlib") is not None:
        out = plot(rollout_doc, tmp_path / "r.png")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(UserError, match="pip install matplotlib"):
        plot(rollout_doc, tmp_path / "s.png")


def test_benchmarks_md_keeps_the_hand_written_part(rollout_doc, tmp_path):
    spec = importlib.util.spec_from_file_location("make_benchmarks_md", REPO / "benchmarks" / "make_benchmarks_md.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    results = tmp_path / "results"
    results.mkdir()
    (results / "rollout.json").write_text(json.dumps(rollout_doc))
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# Benchmarks\n\n{gen.START}\nH100: 12,345 tokens/s (by hand)\n{gen.END}\n\nold generated text\n")
    gen.main(["--results", str(results), "--out", str(page)])
    text = page.read_text()
    assert "H100: 12,345 tokens/s (by hand)" in text and "old generated text" not in text
    assert rollout_doc["command"] in text and rollout_doc["machine"]["cpu"] in text and rollout_doc["date"] in text
    hf = rollout_doc["results"][0]
    assert f"| hf | {hf['load_s']:.1f} | {hf['tokens_per_s']:,.0f} |" in text
    gen.main(["--results", str(results), "--out", str(page)])
    assert page.read_text() == text  # regenerating changes nothing


# ---------------------------------------------------------------------------------------------
# bench train


def _check_train(doc: dict, method: str, steps: int) -> dict:
    assert doc["kind"] == "train"
    (r,) = doc["results"]
    assert (
        r["method"] == method and r["device"] == "cpu" and [s["step"] for s in r["steps"]] == list(range(1, steps + 1))
    )
    steady = r["steps"][1:]
    assert r["tokens_per_s"] == pytest.approx(statistics.median(s["tokens_per_s"] for s in steady))
    assert r["mfu"] == pytest.approx(r["flops_per_step"] / r["time_s"]["step"] / r["peak_flops"]["flops"])
    assert 0 < r["mfu"] < 1 and r["peak_flops"]["flops"] > 1e8  # a measured fp32 matmul peak
    m = r["memory"]
    # the comparison is computed from the two numbers it shows
    assert m["measured_bytes"] == m["rank_peak_bytes"] - m["baseline_bytes"]
    assert m["relative_error"] == pytest.approx((m["measured_bytes"] - m["estimated_bytes"]) / m["measured_bytes"])
    # measured on real rank processes: sampled many times, each a python + torch process (> 100 MiB)
    assert m["samples"] > 3 and m["ranks"] and m["rank_peak_bytes"] == max(m["ranks"].values())
    assert all(100 * 2**20 < b < doc["machine"]["memory_bytes"] for b in m["ranks"].values())
    assert m["baseline_bytes"] > 100 * 2**20 and m["estimated_bytes"] > 0
    return r


def _bench_train(model, method: str, *args: str) -> dict:
    """`rlctl bench train --json` of ``method``: 3 steps of one CPU process, and ``args``."""
    return bench_json(
        "train", "--model", str(model), "--method", method, "--device", "cpu", "--nproc", "1", "--steps", "3", *args
    )


@pytest.mark.slow
def test_train_sft_json(tiny_model_dir, tmp_path):
    doc = _bench_train(
        tiny_model_dir,
        "sft",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
        "--output-dir",
        str(tmp_path / "b"),
    )
    r = _check_train(doc, "sft", 3)
    assert r["tokens_per_step"] == 4 * 32  # every synthetic sequence fills seq_len exactly
    assert set(r["time_s"]) == {"step"}
    # the estimate is the plan's, as `rlctl estimate memory` prints it for the same job
    plan = json.loads((Path(r["run_dir"]) / "plan.json").read_text())
    assert r["memory"]["estimated_bytes"] == plan["estimate"]["peak_bytes"]
    assert f"{r['memory']['relative_error']:.1%}" in rendered(doc)


@pytest.mark.slow
def test_train_grpo_json_splits_the_step(tiny_model_dir):
    doc = _bench_train(
        tiny_model_dir,
        "grpo",
        "--batch-size",
        "2",
        "--n",
        "2",
        "--prompt-len",
        "8",
        "--max-tokens",
        "8",
        "--rollout",
        "hf",
    )
    r = _check_train(doc, "grpo", 3)
    assert {"rollout", "logprobs", "update", "weight_sync", "other"} <= set(r["time_s"])
    t = r["time_s"]
    assert t["other"] == pytest.approx(t["step"] - t["rollout"] - t["logprobs"] - t["update"] - t["weight_sync"])
    assert 0 < r["mfu_update"] < 1
    assert f"{r['mfu_update']:.1%}" in rendered(doc)


def test_synthetic_sft_lengths(tiny_model_dir, tmp_path):
    """fixed: every answer is longer than seq_len (cut to it); spread: answers of many lengths."""
    from transformers import AutoTokenizer

    from rlctl.bench.train import TrainSettings, write_data

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    lengths = {}
    for kind in ("fixed", "spread"):
        (tmp_path / kind).mkdir()
        path = write_data(tiny_model_dir, TrainSettings(seq_len=64, lengths=kind, batch_size=16), tmp_path / kind)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        lengths[kind] = [len(tok(r["messages"][1]["content"])["input_ids"]) for r in rows]
    assert min(lengths["fixed"]) > 64
    assert min(lengths["spread"]) < 40 and len(set(lengths["spread"])) > 10


def test_train_bad_method_is_one_line():
    res = run_cli("bench", "train", "--model", "tiny", "--method", "dop")
    assert res.returncode == 2 and "unknown --method 'dop'" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("bench", "train", "--model", "tiny", "--method", "dpo", "--teacher", "tiny")
    assert res.returncode == 2 and "--teacher is on-policy distillation" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dpo", "rm"])
def test_train_preference_pairs_json(tiny_model_dir, tmp_path, method):
    """dpo / rm on synthetic pairs: a chosen and a rejected answer of about --seq-len / 2 tokens each (rm refuses a
    row longer than --seq-len, so none is cut); the estimate is the plan's."""
    doc = _bench_train(tiny_model_dir, method, "--batch-size", "2", "--seq-len", "64", "--output-dir", str(tmp_path))
    r = _check_train(doc, method, 3)
    assert set(r["time_s"]) == {"step"}
    assert 2 * 2 * 16 <= r["tokens_per_step"] <= 2 * 2 * 64  # 2 pairs, 2 sequences of 64 tokens at most
    plan = json.loads((Path(r["run_dir"]) / "plan.json").read_text())
    assert r["memory"]["estimated_bytes"] == plan["estimate"]["peak_bytes"]
    rows = [json.loads(line) for line in (tmp_path / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(row["chosen"] != row["rejected"] for row in rows)


@pytest.mark.slow
def test_train_grpo_with_a_teacher_times_its_pass_and_plans_it(tiny_model_dir, tmp_path):
    """--teacher: on-policy distillation, the teacher's scoring pass in the step split and in the estimate."""
    doc = _bench_train(
        tiny_model_dir, "grpo", "--batch-size", "2", "--n", "2", "--prompt-len", "8", "--max-tokens", "8",
        "--rollout", "hf", "--teacher", str(tiny_model_dir), "--output-dir", str(tmp_path),
    )  # fmt: skip
    r = _check_train(doc, "grpo", 3)
    t = r["time_s"]
    assert t["teacher"] > 0
    assert t["other"] == pytest.approx(t["step"] - sum(v for k, v in t.items() if k not in ("step", "other")))
    plan = json.loads((Path(r["run_dir"]) / "plan.json").read_text())
    training = plan["estimate"]["phases"]["training"]
    assert training["components"]["teacher_model"] > 0
    cfg = (Path(r["run_dir"]) / "config.yaml").read_text()
    assert f"teacher: {tiny_model_dir}" in cfg


def test_step_flops_of_pairs_and_of_a_teacher():
    """By hand from the per-token figures: rm and dpo with a precomputed reference train every token once; dpo
    with a live reference adds one forward; a teacher adds its forward to the log-prob pass (sampled) or to
    each epoch's update (full)."""
    from rlctl.bench.mfu import forward_flops_per_token, train_flops_per_token
    from rlctl.bench.train import step_flops
    from rlctl.config import build_config

    record = {"tokens": 400}
    fwd, train = 400 * forward_flops_per_token(TINY, 100), 400 * train_flops_per_token(TINY, 100)
    teacher = replace(TINY, num_layers=2 * TINY.num_layers)
    teacher_fwd = 400 * forward_flops_per_token(teacher, 100)
    assert step_flops(TINY, build_config("rm", []), record, 4) == {"update": pytest.approx(train)}
    assert step_flops(TINY, build_config("dpo", []), record, 4) == {"update": pytest.approx(train)}
    live = build_config("dpo", [{"pref": {"precompute_ref": False}}])
    assert step_flops(TINY, live, record, 4) == {"update": pytest.approx(train + fwd)}

    def grpo(**algo):
        cfg = build_config("grpo", [{"algo": {"kl_coef": 0.0, **algo}, "train": {"batch_size": 4}}])
        return step_flops(TINY, cfg, record, 4, teacher)

    assert grpo()["logprobs"] == pytest.approx(teacher_fwd)
    assert grpo(distill="full")["logprobs"] == 0.0
    assert grpo(distill="full", ppo_epochs=2)["update"] == pytest.approx(2 * train + 2 * teacher_fwd)


# ---------------------------------------------------------------------------------------------
# bench convert


def _dcp_checkpoint(model_dir: Path, step_dir: Path) -> int:
    """An rlctl-layout checkpoint of the tiny model written by one process; returns its model bytes."""
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    state = model.state_dict()
    dcp.save({"model": state}, checkpoint_id=str(step_dir))
    (step_dir / "huggingface").mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, step_dir / "huggingface" / f.name)
    (step_dir / "trainer_state.json").write_text(
        json.dumps({"step": 1, "world_size": 1, "method": "sft", "lora": None})
    )
    return sum(t.numel() * t.element_size() for t in state.values())


def test_convert_json(tiny_model_dir, tmp_path):
    step = tmp_path / "checkpoints" / "step_000001"
    model_bytes = _dcp_checkpoint(tiny_model_dir, step)
    doc = bench_json("convert", str(step), "--work", str(tmp_path))
    (r,) = doc["results"]
    assert r["format"] == "rlctl-dcp" and r["model_bytes"] == model_bytes
    assert r["checkpoint_bytes"] == sum(f.stat().st_size for f in step.iterdir() if f.is_file())
    for key in ("copy", "user_copy", "convert"):
        assert r[f"{key}_s"] > 0 and r[f"{key}_gbps"] > 0
    assert r["convert_gbps"] == pytest.approx(model_bytes / r["convert_s"] / 1e9)
    assert r["convert_rss_over_baseline"] == r["convert_peak_rss"] - r["baseline_rss"]
    assert r["baseline_rss"] > 100 * 2**20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # scratch removed
    assert f"{r['convert_gbps']:.2f}" in rendered(doc)


# ---------------------------------------------------------------------------------------------
# bench compare


def test_compare_without_trl_says_how_to_install(monkeypatch):
    from rlctl.bench.compare import CompareSettings
    from rlctl.errors import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    with pytest.raises(UserError, match="pip install trl"):
        CompareSettings().check()
    with pytest.raises(UserError, match="unknown --peer 'verl'"):
        CompareSettings(peer="verl").check()


def _compare_trl(model, *args: str) -> dict:
    """`rlctl bench compare --peer trl --json` of ``model``: one rep of 2 steps on the CPU, and ``args``."""
    return bench_json(
        "compare", "--peer", "trl", "--model", str(model), "--reps", "1", "--steps", "2", "--device", "cpu", *args
    )


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed")
def test_compare_trl_json(tiny_model_dir):
    doc = _compare_trl(
        tiny_model_dir,
        "--work",
        "rollout,sft,grpo",
        "--prompts",
        "2",
        "--n",
        "2",
        "--max-tokens",
        "8",
        "--prompt-len",
        "8",
        "--batch-size",
        "4",
        "--seq-len",
        "32",
    )
    rows = {r["work"]: r for r in doc["results"]}
    assert set(rows) == {"rollout", "sft", "grpo"}
    for r in rows.values():
        assert r["rlctl"]["tokens_per_s"] > 0 and r["trl"]["tokens_per_s"] > 0
        assert r["ratio_tokens_per_s"] == pytest.approx(r["rlctl"]["tokens_per_s"] / r["trl"]["tokens_per_s"])
    for r in (rows["sft"], rows["grpo"]):  # tokens per CPU second of the training process, both sides
        a, b = r["rlctl"], r["trl"]
        assert a["tokens_per_cpu_s"] > 0 and b["tokens_per_cpu_s"] > 0
        assert r["ratio_tokens_per_cpu_s"] == pytest.approx(a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"])
        assert all(step["cpu_s"] > 0 for run in a["runs"] + b["runs"] for step in run[1:])
    assert rows["rollout"]["rlctl"]["engine"] == "hf" and rows["rollout"]["trl"]["engine"] == "trl"
    # the same SFT work on both sides: 4 sequences of 32 tokens per step
    assert rows["sft"]["rlctl"]["tokens_per_step"] == rows["sft"]["trl"]["tokens_per_step"] == 128
    assert f"{rows['grpo']['ratio_tokens_per_s']:.2f}x" in rendered(doc)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed")
def test_compare_trl_sft_spread_runs_packing_at_the_same_batch(tiny_model_dir):
    doc = _compare_trl(
        tiny_model_dir,
        "--work",
        "sft",
        "--lengths",
        "spread",
        "--batch-size",
        "4",
        "--seq-len",
        "96",
    )
    (r,) = doc["results"]
    a, packed = r["rlctl"], r["trl_packing"]
    # TRL packs 4 rows of <= 96 tokens and concatenates them (padding free): one sequence of up to 384
    assert 96 < packed["tokens_per_step"] <= 4 * 96 and a["tokens_per_step"] <= 4 * 96
    assert r["ratio_tokens_per_cpu_s_packing"] == pytest.approx(a["tokens_per_cpu_s"] / packed["tokens_per_cpu_s"])
    assert "with packing, batch 4" in rendered(doc)


def test_spread_chats_cover_short_to_max_len():
    from rlctl.bench.chats import make_chats, render_ids
    from rlctl.testing import build_tokenizer

    tok = build_tokenizer()
    lengths = [len(render_ids(tok, c["messages"])) for c in make_chats(64, 512, tok)]
    assert min(lengths) < 64 and 256 < max(lengths) <= 512
    assert statistics.median(lengths) < statistics.mean(lengths)  # log-uniform: many short, a few long


def test_cpu_clock_reads_rank_cpu_at_metrics_times():
    """rlctl's steps get the ranks' CPU seconds between consecutive metrics records, interpolated
    between the clock's samples; a step's tokens over them is its tokens per CPU second."""
    from rlctl.bench.common import CpuClock
    from rlctl.bench.compare import _side, periods

    clock = CpuClock(lambda argv: False)
    clock.samples = [(100.0, 1.0), (102.0, 3.0), (104.0, 4.0)]
    assert clock.at(101.0) == pytest.approx(2.0) and clock.at(103.0) == pytest.approx(3.5)
    assert clock.at(50.0) == 1.0 and clock.at(200.0) == 4.0  # outside the samples: the nearest
    records = [
        {"step": 1, "time": 101.0, "time/step": 5.0, "tokens": 10},
        {"step": 2, "time": 103.0, "time/step": 1.5, "tokens": 30},
        {"step": 3, "time": 104.0, "time/step": 0.9, "tokens": 20},
    ]
    steps = periods(records, clock)
    assert "cpu_s" not in steps[0]  # the warm-up step has no start mark
    assert [s["cpu_s"] for s in steps[1:]] == pytest.approx([1.5, 0.5])
    assert [s["time/step"] for s in steps] == pytest.approx([5.0, 2.0, 1.0])
    assert _side([steps], [])["tokens_per_cpu_s"] == pytest.approx(50 / 2.0)


def test_cpu_clock_samples_a_child_process():
    from rlctl.bench.common import CpuClock

    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    with CpuClock(lambda argv: "-c" in argv and code in argv, interval=0.01) as clock:
        subprocess.run([sys.executable, "-c", code], check=True)
    assert 0.2 < clock.samples[-1][1] < 1.5


def test_cli_module_does_not_import_torch():
    code = "import sys, rlctl.cli.bench; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"


def test_rollout_memory_of_sglang_is_the_devices(monkeypatch):
    """SGLang's model and KV pool live in its scheduler's child processes: the worker's own allocator sees
    ~0, so on a GPU its peak is the device memory in use less what was in use before the engine (FAKE
    torch.cuda counters: no GPU here)."""
    import torch

    from rlctl.bench.rollout import _Memory

    used = {"device": 3 * 2**30}
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 5 * 2**20)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (80 * 2**30 - used["device"], 80 * 2**30))
    sglang, vllm = _Memory("cuda", "sglang"), _Memory("cuda", "vllm")
    used["device"] += 30 * 2**30  # the engine's weights and KV pool, in SGLang's processes
    sglang.observe()
    vllm.observe()
    assert sglang.report()["peak_bytes"] == 30 * 2**30
    assert vllm.report()["peak_bytes"] == 5 * 2**20  # in-process engines: the allocator's own peak
    assert vllm.report()["device_used_bytes"] == 33 * 2**30
