"""SFT: data (masks, formats, bad rows, packing, world-size-free order) and whole runs under torchrun.

The runs use a tiny Qwen2 on CPU with gloo. One uninterrupted 2-process run is the reference; a
second run is killed while writing its step-4 checkpoint, resumed on ONE process that stops after
step 4 (as on Ctrl-C), and resumed again on two processes: its losses must match the reference.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlctl.errors import UserError
from tests.support.cli import REPO
from tests.support.sft import chat_rows, cpu_plan, losses, pair_rows, sft_config, write_jsonl

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def cfg_for(tiny_model_dir, data, tmp_path, **sets):
    return sft_config(tiny_model_dir, data, tmp_path / "run", **sets)


def trained_text(tok, ex) -> str:
    """Decode the target tokens of an example (labels are already shifted)."""
    return tok.decode(ex.labels[ex.labels != -100].tolist())


# ---------------------------------------------------------------------------------------------
# Data


def test_chat_loss_covers_exactly_the_assistant_turns(tok, tiny_model_dir, tmp_path):
    from rlctl.data.sft import build_sft_data

    rows = [
        {
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 3 + 4?"},
                {"role": "assistant", "content": "The answer is 7. #### 7"},
                {"role": "user", "content": "Compute 3 * 4"},
                {"role": "assistant", "content": "3 * 4 = 12"},
            ]
        }
    ]
    cfg = cfg_for(tiny_model_dir, write_jsonl(tmp_path / "d.jsonl", rows), tmp_path, train__max_len=512)
    (ex,) = build_sft_data(cfg, tok).train
    # ChatML: each assistant turn renders as "<|im_start|>assistant\n{content}<|im_end|>\n"
    assert trained_text(tok, ex) == f"The answer is 7. #### 7{IM_END}\n3 * 4 = 12{IM_END}\n"
    full = tok.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert tok.decode(ex.input_ids.tolist()) == full
    # labels are the next token wherever they are set
    j = np.nonzero(ex.labels != -100)[0]
    assert (ex.labels[j] == ex.input_ids[j + 1]).all() and ex.labels[-1] == -100


def test_pairs_train_on_the_response_only(tok, tiny_model_dir, tmp_path):
    from rlctl.data.sft import build_sft_data

    rows = [{"prompt": "Compute 9 - 4", "response": "9 - 4 = 5"}, {"question": "Compute 2 - 1", "answer": "2 - 1 = 1"}]
    cfg = cfg_for(
        tiny_model_dir,
        write_jsonl(tmp_path / "p.jsonl", rows),
        tmp_path,
        data__prompt_field="prompt",
        data__max_bad_fraction=0.5,
    )
    data = build_sft_data(cfg, tok)
    assert [trained_text(tok, ex) for ex in data.train] == [f"9 - 4 = 5{IM_END}\n"]
    assert data.report.num_bad == 1
    # other field names
    cfg = cfg_for(
        tiny_model_dir,
        tmp_path / "p.jsonl",
        tmp_path,
        data__prompt_field="question",
        data__response_field="answer",
        data__format="pairs",
        data__max_bad_fraction=0.5,
    )
    assert [trained_text(tok, ex) for ex in build_sft_data(cfg, tok).train] == [f"2 - 1 = 1{IM_END}\n"]


def test_pairs_without_chat_template(tok, tiny_model_dir, tmp_path):
    from rlctl.data.sft import row_tokens

    tok = tok.__class__.from_pretrained(str(tiny_model_dir))
    tok.chat_template = None
    cfg = cfg_for(tiny_model_dir, tmp_path / "x.jsonl", tmp_path)
    ids, mask = row_tokens({"prompt": "Compute 9 - 4", "response": " 9 - 4 = 5"}, tok, cfg)
    prompt_ids = tok("Compute 9 - 4")["input_ids"]
    assert ids[: len(prompt_ids)] == prompt_ids and ids[-1] == tok.eos_token_id
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == f" 9 - 4 = 5{IM_END}"


def test_truncation_policies(tok, tiny_model_dir, tmp_path):
    from rlctl.data.sft import BadRow, make_example

    ids = list(range(10, 30))
    mask = [0] * 10 + [1] * 10
    with pytest.raises(BadRow, match="longer than max_len 8"):
        make_example(ids, mask, max_len=8, truncation="skip")
    left = make_example(ids, mask, max_len=8, truncation="left")
    assert left.input_ids.tolist() == list(range(22, 30)) and left.labels.tolist() == list(range(23, 30)) + [-100]
    with pytest.raises(BadRow, match="no assistant tokens left"):
        make_example(ids, mask, max_len=8, truncation="right")  # only prompt tokens remain
    right = make_example(ids, mask, max_len=13, truncation="right")
    assert right.labels.tolist() == [-100] * 9 + [20, 21, 22, -100]


def test_bad_rows_are_counted_and_too_many_fail(tok, tiny_model_dir, tmp_path):
    from rlctl.data.sft import build_sft_data

    rows = chat_rows(7) + ["{broken", {"messages": [{"role": "user", "content": "hi"}]}, {"text": "no fields"}]
    data_file = write_jsonl(tmp_path / "bad.jsonl", rows)
    data = build_sft_data(cfg_for(tiny_model_dir, data_file, tmp_path, data__max_bad_fraction=0.3), tok)
    assert len(data.train) == 7 and data.report.total == 10 and data.report.num_bad == 3
    assert data.report.bad["no assistant turn"] == 1 and data.report.bad["line is not valid JSON"] == 1
    with pytest.raises(UserError) as e:
        build_sft_data(cfg_for(tiny_model_dir, data_file, tmp_path, data__max_bad_fraction=0.2), tok)
    msg = str(e.value)
    assert "too many bad rows" in msg and "3 of 10" in msg and "\n" not in msg
    # rows longer than max_len count as bad under truncation=skip
    long = build_sft_data(
        cfg_for(tiny_model_dir, data_file, tmp_path, train__max_len=60, data__max_bad_fraction=1.0), tok
    )
    assert long.report.bad["longer than max_len 60 (raise --max-len or set data.truncation=right)"] == 2


def test_parquet_and_datasets_dir_read_like_jsonl(tok, tiny_model_dir, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlctl.data.sft import build_sft_data

    rows = chat_rows(6) + pair_rows(2)
    rows = [{"messages": r.get("messages"), "prompt": r.get("prompt"), "response": r.get("response")} for r in rows]
    rows = [{k: v for k, v in r.items() if v is not None} for r in rows]
    chats = [r for r in rows if "messages" in r]
    pq.write_table(pa.Table.from_pylist(chats), tmp_path / "d.parquet")
    datasets.Dataset.from_list(chats).save_to_disk(str(tmp_path / "ds"))
    jsonl = write_jsonl(tmp_path / "d.jsonl", chats)
    got = {
        name: build_sft_data(cfg_for(tiny_model_dir, path, tmp_path), tok).train
        for name, path in [("jsonl", jsonl), ("parquet", tmp_path / "d.parquet"), ("ds", tmp_path / "ds")]
    }
    ref = [ex.input_ids.tolist() for ex in got["jsonl"]]
    assert len(ref) == 6
    for name in ("parquet", "ds"):
        assert [ex.input_ids.tolist() for ex in got[name]] == ref, name


def test_val_fraction_holds_out_rows(tok, tiny_model_dir, tmp_path):
    from rlctl.data.sft import build_sft_data

    data_file = write_jsonl(tmp_path / "d.jsonl", chat_rows(20))
    data = build_sft_data(cfg_for(tiny_model_dir, data_file, tmp_path, data__val_fraction=0.2), tok)
    assert len(data.train) == 16 and len(data.val) == 4

    def ids(exs):
        return {tuple(ex.input_ids.tolist()) for ex in exs}

    assert not ids(data.train) & ids(data.val)


def test_pack_bins_first_fit_decreasing_by_hand():
    from rlctl.data.packing import pack_bins

    # sorted: 60 -> bin0 (40 left), 50 -> bin1 (50 left), 40 -> bin0 (full), 30 -> bin1 (20 left), 20 -> bin1
    assert pack_bins([60, 50, 40, 30, 20], 100) == [[0, 2], [1, 3, 4]]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 64, size=50).tolist()
    bins = pack_bins(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(50))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)


def _examples(lengths):
    from rlctl.data.sft import Example

    out = []
    for k, n in enumerate(lengths):
        ids = np.arange(n, dtype=np.int32) + 100 * k
        labels = np.concatenate([ids[1:], [-100]]).astype(np.int32)
        out.append(Example(ids, labels))
    return out


def test_packed_micro_batch_layout():
    from rlctl.data.packing import collate_packed

    mb = collate_packed(_examples([3, 2]))
    assert mb.input_ids.tolist() == [[0, 1, 2, 100, 101]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.labels.tolist() == [[1, 2, -100, 101, -100]]  # no target across the document boundary
    assert mb.attention_mask is None and mb.num_tokens == 5 and mb.num_loss_tokens == 3


@pytest.mark.parametrize("packing", [True, False])
def test_rank_split_covers_the_global_batch_for_any_world_size(packing):
    from rlctl.data.packing import StepSampler, rank_micro_batches

    batch = _examples([5, 9, 3, 7, 12, 4, 8])
    seen = {}
    for world in (1, 2, 3, 4):
        per_rank = [
            rank_micro_batches(batch, r, world, packing=packing, budget=16, micro_batch_size=2, pad_id=0)
            for r in range(world)
        ]
        assert len({len(m) for m in per_rank}) == 1  # same number of passes on every rank
        docs = sorted(
            int(t)
            for mbs in per_rank
            for mb in mbs
            for t, p in zip(mb.input_ids.flatten(), mb.position_ids.flatten())
            if p == 0 and mb.num_seqs
        )
        tokens = sum(mb.num_loss_tokens for mbs in per_rank for mb in mbs)
        seen[world] = (docs, tokens)
    assert all(v == seen[1] for v in seen.values())
    assert seen[1][1] == sum(ex.num_loss_tokens for ex in batch)
    # the global batch of a step depends on the step only
    s = StepSampler(10, 4, seed=3)
    assert s.steps_per_epoch == 3 and len(s.indices(2)) == 2
    assert sorted(i for k in range(3) for i in s.indices(k)) == list(range(10))
    assert s.indices(3) != s.indices(0) and StepSampler(10, 4, seed=3).indices(4) == s.indices(4)


def test_micro_batches_are_dealt_by_data_parallel_replica(tiny_model_dir, tmp_path):
    """A fake Megatron layout on 4 ranks, tp 2 x dp 2 (megatron_parallel.rank_coords: ranks 0, 1 are
    replica 0, ranks 2, 3 replica 1): the two TP ranks of a replica get the same micro-batches, the two
    replicas split the global batch (every document once, every loss token counted once)."""
    from rlctl.engines.megatron.parallel import rank_coords
    from rlctl.recipes.sft import SFTTrainer

    cfg = cfg_for(
        tiny_model_dir, tmp_path / "unused.jsonl", tmp_path, train__max_tokens_per_micro_batch=16, train__max_len=16
    )
    batch = _examples([5, 9, 3, 7, 12, 4, 8])
    dealt = {}
    for rank in range(4):
        dp = rank_coords(rank, 4, tp=2, pp=1)["dp"]
        engine = SimpleNamespace(dp_rank=dp, dp_size=2, device=torch.device("cpu"))
        trainer = SFTTrainer(
            SimpleNamespace(cfg=cfg, plan=SimpleNamespace()), engine, None, None, pad_id=0, total_steps=1
        )
        dealt[rank] = trainer._micro_batches(batch)
    as_lists = {r: [(mb.input_ids.tolist(), mb.labels.tolist()) for mb in mbs] for r, mbs in dealt.items()}
    assert as_lists[0] == as_lists[1] and as_lists[2] == as_lists[3] and as_lists[0] != as_lists[2]
    firsts = sorted(
        int(t)
        for r in (0, 2)
        for mb in dealt[r]
        if mb.num_seqs  # a document's first token is 100 k
        for t, p in zip(mb.input_ids.flatten(), mb.position_ids.flatten())
        if p == 0
    )
    assert firsts == [100 * k for k in range(len(batch))]
    assert sum(mb.num_loss_tokens for r in (0, 2) for mb in dealt[r]) == sum(ex.num_loss_tokens for ex in batch)


# ---------------------------------------------------------------------------------------------
# Whole runs (torchrun, gloo)

SAVE_RUN = {"checkpoint__save_every": 2, "data__val_fraction": 0.1, "train__eval_every": 3}


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("sft") / "chat.jsonl", chat_rows(40) + ["not json", {"foo": 1}])


@pytest.fixture(scope="module")
def reference_run(tiny_model_dir, chat_file, tmp_path_factory) -> Path:
    """6 steps on 2 processes, checkpoints every 2 steps, the final logits dumped for the export check."""
    from rlctl.launch import launch_job

    out = tmp_path_factory.mktemp("ref") / "run"
    cfg = sft_config(tiny_model_dir, chat_file, out, **SAVE_RUN)
    os.environ["RLCTL_DUMP_LOGITS"] = "1"
    try:
        assert launch_job(cfg, cpu_plan(2)) == 0
    finally:
        del os.environ["RLCTL_DUMP_LOGITS"]
    return out


@pytest.mark.slow
def test_two_process_run_trains_checkpoints_and_exports(reference_run, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rlctl.metrics import read_metrics

    run = reference_run
    records = read_metrics(run / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    for key in ("lr", "grad_norm", "tokens_per_s", "time/step", "total_steps"):
        assert key in train[0]
    assert [r["step"] for r in records if r.get("kind") == "eval"] == [3, 6]
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000004", "step_000006"]  # keep_last 2
    assert (ckpts / "latest").read_text().strip() == "step_000006"
    state = json.loads((ckpts / "step_000006" / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["world_size"] == 2 and state["lora"] is None
    assert (ckpts / "step_000006" / "huggingface" / "tokenizer_config.json").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["data"]["bad"] == 2
    # the exported model reproduces the sharded model's logits and differs from the initial one
    dumped = torch.load(run / "debug_logits.pt")
    exported = AutoModelForCausalLM.from_pretrained(str(run / "hf"), dtype=torch.float32, attn_implementation="sdpa")
    initial = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        got = exported(input_ids=dumped["input_ids"]).logits
        before = initial(input_ids=dumped["input_ids"]).logits
    assert (got - dumped["logits"]).abs().max().item() <= 1e-5
    assert (before - dumped["logits"]).abs().max().item() > 1e-2


@pytest.mark.slow
def test_crash_in_save_then_resume_on_other_process_counts(reference_run, tiny_model_dir, chat_file, tmp_path):
    from rlctl.launch import INTERRUPTED, launch_job

    out = tmp_path / "run"

    def launch(nproc, env, **sets):
        os.environ.update(env)
        try:
            return launch_job(sft_config(tiny_model_dir, chat_file, out, **SAVE_RUN, **sets), cpu_plan(nproc))
        finally:
            for k in env:
                del os.environ[k]

    # 1. rank 0 is killed while writing the step-4 checkpoint: step 2 stays the latest, intact
    assert launch(2, {"RLCTL_KILL_DURING_SAVE": "4"}) != 0
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000002"
    assert (ckpts / ".tmp-step_000004").is_dir() and not (ckpts / "step_000004").exists()
    # 2. resume on ONE process from step 2, stop after step 4 as on Ctrl-C (checkpoint, exit 130)
    assert launch(1, {"RLCTL_STOP_AFTER_STEP": "4"}, checkpoint__resume="auto") == INTERRUPTED
    assert (ckpts / "latest").read_text().strip() == "step_000004"
    assert json.loads((ckpts / "step_000004" / "trainer_state.json").read_text())["world_size"] == 1
    # 3. resume on two processes to the end
    assert launch(2, {}, checkpoint__resume="auto") == 0
    ref, got = losses(reference_run), losses(out)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in range(3, 7):
        assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=1e-6), step


@pytest.mark.slow
def test_lora_run_exports_merged_weights(tiny_model_dir, chat_file, tmp_path):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from rlctl.launch import launch_job

    out = tmp_path / "run"
    cfg = sft_config(
        tiny_model_dir,
        chat_file,
        out,
        train__max_steps=3,
        lora__rank=4,
        lora__alpha=16,
        lora__targets="q_proj,v_proj",
        train__lr=1e-2,
    )
    assert launch_job(cfg, cpu_plan(2)) == 0
    step = out / "checkpoints" / "step_000003"
    assert json.loads((step / "lora_adapter" / "adapter_config.json").read_text())["r"] == 4
    assert json.loads((step / "trainer_state.json").read_text())["lora"]["lora_alpha"] == 16
    dcp_to_torch_save(step, tmp_path / "ckpt.pt")
    model_state = torch.load(tmp_path / "ckpt.pt", weights_only=False)["model"]
    hf = load_file(out / "hf" / "model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    assert set(hf) == set(base)
    for layer in range(2):
        for proj in ("q_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}"
            peft = f"base_model.model.{name}"
            a = model_state[f"{peft}.lora_A.default.weight"]
            b = model_state[f"{peft}.lora_B.default.weight"]
            assert torch.equal(model_state[f"{peft}.base_layer.weight"], base[f"{name}.weight"])  # frozen
            assert b.abs().max() > 0
            expected = base[f"{name}.weight"] + (b @ a) * (16 / 4)
            assert torch.allclose(hf[f"{name}.weight"], expected, atol=1e-6)
            assert not torch.allclose(hf[f"{name}.weight"], base[f"{name}.weight"])
        k = f"model.layers.{layer}.self_attn.k_proj.weight"
        assert torch.equal(hf[k], base[k])


@pytest.mark.slow
def test_bad_data_ends_in_one_line_error(tiny_model_dir, tmp_path):
    """Too many bad rows, found on the ranks: `rlctl sft` prints one line and exits with status 2."""
    from tests.support.cli import run_cli  # noqa: F401

    data_file = write_jsonl(tmp_path / "bad.jsonl", chat_rows(3) + [{"text": "x"}] * 3)
    proc = run_cli(
        "sft",
        "--model",
        str(tiny_model_dir),
        "--data",
        str(data_file),
        "--device",
        "cpu",
        "--nproc",
        "1",
        "--max-len",
        "96",
        "--max-steps",
        "2",
        "-o",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if "too many bad rows" in line]
    assert len(errors) == 1 and errors[0].startswith("error: ") and "3 of 6 rows" in errors[0]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "run").exists()  # refused on the ranks: no run directory left (issue 37)


def test_bad_options_fail_before_launch(tiny_model_dir, chat_file, tmp_path):
    from rlctl.checks import check_job
    from rlctl.launch import build_command

    cases = [
        ({"data__path": str(tmp_path / "missing.jsonl")}, "data file not found"),
        ({"checkpoint__resume": str(tmp_path / "nope")}, "no complete checkpoint"),
        ({"log__backends": "console,tensorbord"}, "did you mean tensorboard"),
    ]
    for sets, message in cases:
        with pytest.raises(UserError, match=message):
            check_job(sft_config(tiny_model_dir, chat_file, tmp_path / "run", **sets), cpu_plan(1))
        assert not (tmp_path / "run").exists()
    argv = build_command(sft_config(tiny_model_dir, chat_file, tmp_path / "r"), SimpleNamespace(**cpu_plan(2)), "RUN")
    assert argv[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node"] and argv[4] == "2"
    assert argv[-4:] == ["-m", "rlctl.recipes.sft", "--run-dir", "RUN"]
    port = int(argv[argv.index("--master-port") + 1])
    assert port > 0


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_130(tiny_model_dir, chat_file, tmp_path):
    """A real SIGINT to the launcher: the ranks finish their step, save, and the launcher returns 130."""
    import time

    out = tmp_path / "run"
    script = (
        "import sys; from pathlib import Path; from tests.support.sft import cpu_plan, sft_config\n"
        "from rlctl.launch import launch_job\n"
        f"cfg = sft_config(Path({str(tiny_model_dir)!r}), Path({str(chat_file)!r}), Path({str(out)!r}), "
        "train__max_steps=500)\n"
        "sys.exit(launch_job(cfg, cpu_plan(2)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.time() + 240
    while time.time() < deadline and not any(r.get("step", 0) >= 2 for r in _records(out)):
        time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 2 <= summary["step"] < 500
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{summary['step']:06d}"
    assert not (out / "hf").exists() and "--resume auto" in output


def _records(run: Path) -> list[dict]:
    from rlctl.metrics import read_metrics

    return read_metrics(run / "metrics.jsonl")
