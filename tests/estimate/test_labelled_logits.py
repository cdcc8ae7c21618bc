"""sft and dpo run the LM head at the labelled positions only (rlctl.data.packing.labelled_columns): the
estimate counts their logits there, at the labelled share measured on the data's first rows
(rlctl.data.labelled) or the stated default, and says which in its reasons."""

from __future__ import annotations

import math

import pytest

from rlctl.catalog import resolve_model
from rlctl.estimate import MemorySettings, estimate_memory
from rlctl.estimate.settings import DEFAULT_LABELLED_FRACTION
from rlctl.estimate.training import logit_tokens
from tests.estimate.test_estimate import BIG, V, est, train
from tests.support.pref import format_pairs
from tests.support.sft import chat_rows, sft_config, write_jsonl

PER_LOGIT = 2 + 2 + 4 + 4  # bf16 logits and gradient, fp32 log-softmax and gradient


def test_sft_and_dpo_logits_at_the_labelled_positions_by_hand():
    # sft: 2 x 4096 tokens per micro batch, a quarter labelled
    assert train(est(gpus=8, method="sft", max_len=4096, micro_batch=2, labelled_fraction=0.25))["logits"] == (
        2048 * V * PER_LOGIT
    )
    # dpo: a pair's two sequences of 1024 (2048 positions), 30% labelled: ceil(614.4) positions
    assert train(est(gpus=8, method="dpo", max_len=1024, labelled_fraction=0.3))["logits"] == 615 * V * PER_LOGIT
    # Ulysses sp 2: each GPU holds 4096 of the 8192 positions; at worst all 2048 labelled ones are in its shard
    sp = est(gpus=8, method="sft", max_len=4096, micro_batch=2, sp=2, labelled_fraction=0.25)
    assert train(sp)["logits"] == 2048 * V * PER_LOGIT
    assert train(est(gpus=8, method="sft", max_len=4096, micro_batch=2, sp=2, labelled_fraction=0.75))["logits"] == (
        4096 * V * PER_LOGIT  # more labelled positions than a shard holds: the shard's
    )
    # a chunked loss: one chunk of the labelled positions
    chunked = est(gpus=8, method="sft", max_len=4096, micro_batch=2, labelled_fraction=0.1, loss_chunk=1024)
    assert train(chunked)["logits"] == 820 * V * (2 + 12)
    # Megatron's output layer runs at every position (its vocab-parallel loss: bf16 logits and gradient, + 4 fp32
    # row chunks of 2**25 values); rm has no LM head
    assert (
        train(est(gpus=8, method="sft", backend="megatron", tp=4, max_len=4096, labelled_fraction=0.25))["logits"]
        == 4096 * (V // 4) * (2 + 2) + 4 * 4 * 2**25
    )
    assert train(est(gpus=8, method="rm", max_len=1024, labelled_fraction=0.3))["logits"] == 0


def test_the_default_is_stated_and_the_reasons_name_the_share():
    every = est(gpus=8, method="sft", max_len=4096)
    assert DEFAULT_LABELLED_FRACTION == 1.0
    assert train(every)["logits"] == 4096 * V * PER_LOGIT
    assert any("labelled positions only: 100%" in a and "the default: no data measured" in a for a in every.assumptions)
    measured = est(gpus=8, method="dpo", max_len=1024, labelled_fraction=0.3)
    assert any("labelled positions only: 30%" in a and "measured on the data" in a for a in measured.assumptions)
    assert not any("labelled positions only" in a for a in est(gpus=8).assumptions)  # grpo: response positions


def test_a_labelled_fraction_outside_0_1_is_one_line():
    from rlctl.errors import UserError

    with pytest.raises(UserError, match="labelled_fraction must be in"):
        estimate_memory(resolve_model("Qwen2.5-7B"), BIG, MemorySettings(method="sft", labelled_fraction=1.5))


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_the_share_measured_on_the_data_is_what_the_engine_keeps(method, tiny_model_dir, tmp_path):
    """The data's measured share (rlctl.data.labelled) against the columns the recipe's micro-batches of the
    same rows keep (the head's rows): counted independently, the labels of each sequence. The plan of a job
    with that data carries the share into its estimate."""
    import numpy as np

    from rlctl.config import build_config, dotted_to_nested
    from rlctl.data.labelled import labelled_fraction
    from rlctl.data.preference import build_pref_data
    from rlctl.data.sft import build_sft_data, use_chat_template
    from rlctl.engines.base import load_tokenizer, model_source
    from rlctl.job import resolve_job

    if method == "sft":
        data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
        cfg = sft_config(tiny_model_dir, data, tmp_path / "run")
    else:
        data = write_jsonl(tmp_path / "p.jsonl", format_pairs(12))
        sets = {"model.name": str(tiny_model_dir), "data.path": str(data), "train.max_len": 64, "data.val_fraction": 0}
        cfg = build_config("dpo", [dotted_to_nested(sets)])
    tok = use_chat_template(load_tokenizer(model_source(str(tiny_model_dir))), cfg)
    share = labelled_fraction(cfg, tok)
    if method == "sft":  # packed documents: a document's labelled positions are its own columns
        seqs = build_sft_data(cfg, tok).train
        labelled, positions = sum(int((s.labels != -100).sum()) for s in seqs), sum(len(s) for s in seqs)
    else:  # a pair's unlabelled common prompt held once, each answer up to its last label (docs/dpo.md)
        units = build_pref_data(cfg, tok, paired=True, loss="sigmoid").train
        labelled = sum(int((s.labels != -100).sum()) for u in units for s in u.seqs)
        positions = 0
        for u in units:
            (a, b), n = u.seqs, min(map(len, u.seqs)) - 1
            same = (a.input_ids[:n] == b.input_ids[:n]) & (a.labels[:n] == -100) & (b.labels[:n] == -100)
            p = int(np.cumprod(same).sum())
            positions += p + sum(int(np.flatnonzero(s.labels != -100)[-1]) + 1 - p for s in u.seqs)
    assert 0 < share < 1 and share == pytest.approx(labelled / positions, rel=1e-9)
    tokens = 4096
    assert logit_tokens(MemorySettings(method=method, micro_batch_tokens=tokens, labelled_fraction=share)) == (
        math.ceil(tokens * share)
    )
    job = resolve_job(
        method, options={"model.name": str(tiny_model_dir), "data.path": str(data)}, defaults=CPU, measure_data=True
    )
    planned = labelled_fraction(job.cfg, tok)  # the job's own max_len
    dry_run = resolve_job(method, options={"model.name": str(tiny_model_dir), "data.path": str(data)}, defaults=CPU)
    assert any("100% of each micro batch's (the default" in a for a in _reasons(dry_run))  # a training command's
    assert any(f"labelled positions only: {planned:.0%} of each micro batch's (measured" in a for a in _reasons(job))


CPU = {"hardware.device": "cpu"}


def _reasons(job) -> list[str]:
    return job.plan.estimate.assumptions
