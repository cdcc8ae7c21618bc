"""Ulysses sequence parallelism (sp) in the estimator and the CLI, against hand-worked counts.

Qwen2.5-7B: hidden 3584, MLP 18944, 28 layers, 28 heads and 4 KV heads of 128 (q = 3584, kv = 512),
vocabulary 152064. GRPO with a 512-token prompt and a 32768-token response: T = 33280 tokens per
sequence, so each GPU of an SP group of size N computes T / N tokens, their logits and their losses
(rlctl.engines.ulysses keeps the logits on their shard).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rlctl.catalog import resolve_model
from rlctl.catalog.spec import GpuSpec
from rlctl.errors import UserError
from rlctl.estimate import MemorySettings, estimate_memory

H, F, L, V = 3584, 18944, 28, 152064
Q, KV = 28 * 128, 4 * 128
T = 512 + 32768
BIG = GpuSpec("test-1TB", 10**12, 0.0, "NVLink", 0.0, 8)
LONG = {"method": "grpo", "gpus": 8, "response_len": 32768}


def train(model="Qwen2.5-7B", **kw):
    return estimate_memory(resolve_model(model), BIG, MemorySettings(**kw)).phases["training"].components


@pytest.mark.parametrize("sp", [1, 2, 4])
def test_activations_and_logits_are_those_of_t_over_sp_tokens(sp):
    c = train(**LONG, sp=sp)
    t = T // sp
    full_layer = 2 * t * (4 * H + 2 * Q + 2 * KV + 4 * F)  # bf16: norms and inputs, Q K V out, gated MLP
    assert c["activations"] == L * 2 * t * H + full_layer  # checkpointing: each layer's input + one recomputed
    # the logits of the response positions the GPU holding the sequence's end computes: the whole response
    # (32768 of 33280 positions) at sp 1, its whole shard when the response is longer than a shard
    assert c["logits"] == min(t, 32768) * V * (2 + 2 + 4 + 4)
    one = train(**LONG, sp=1)
    assert c["activations"] * sp == one["activations"]
    for key in ("weights", "gradients", "optimizer_states", "unsharded_buffers", "reference_model"):
        assert c[key] == one[key]  # FSDP2 shards the states over all 8 GPUs (dp x sp), whatever sp is


def test_a_chunked_loss_under_sp_holds_one_chunk_of_the_shard():
    chunk = 1024
    assert train(**LONG, loss_chunk=chunk, sp=2)["logits"] == chunk * V * (2 + 12)  # one chunk, as at sp 1
    # RL with a chunked loss: logits at the response positions of the shard only (the last shard: all of it,
    # the response being longer than a shard); a short shard is one chunk
    assert train(**LONG, loss_chunk=65536, sp=4)["logits"] == (T // 4) * V * (2 + 12)
    short = {**LONG, "prompt_len": 4096, "response_len": 256}  # a response shorter than a shard (4352 / 4)
    assert train(**short, loss_chunk=65536, sp=4)["logits"] == 256 * V * (2 + 12)


def test_all_to_all_buffers_by_hand():
    assert "sp_all_to_all" not in train(**LONG)
    t = T // 2
    # the layer in flight: its Q, K, V in the sequence layout beside their traded copies, and one trade's
    # send and receive buffers (Q's, the largest)
    in_flight = (Q + 2 * KV) + 2 * Q
    ckpt = train(**LONG, sp=2)
    assert ckpt["sp_all_to_all"] == 2 * t * (in_flight + Q)  # + the recomputed layer's output in both layouts
    none = train(**LONG, sp=2, activation_checkpointing=False)
    assert none["sp_all_to_all"] == 2 * t * (in_flight + L * Q)  # every layer keeps its output twice
    # Qwen2.5-1.5B (12 heads, 2 KV heads of 128): sp 4 repeats each KV head twice, one per GPU
    q, kv, kv4 = 12 * 128, 2 * 128, 4 * 128
    small = train("Qwen2.5-1.5B", method="sft", gpus=8, max_len=8192, sp=4)
    repeated_in_flight = (q + 2 * kv) + 2 * kv4 + 2 * q
    assert small["sp_all_to_all"] == 2 * 2048 * (repeated_in_flight + q + 2 * (kv4 - kv))


def test_sp_settings_that_cannot_run_are_one_line_errors():
    with pytest.raises(
        UserError, match=r"parallel.sp=8: 8 does not divide the 28 attention heads \(Qwen2.5-7B on 8 ranks\)"
    ):
        train(**LONG, sp=8)
    with pytest.raises(UserError, match="parallel.sp=3: 3 does not divide the 8 ranks"):
        train(**LONG, sp=3)
    with pytest.raises(UserError, match="parallel.sp=2 is the FSDP engine's; Megatron splits sequences with --cp"):
        train(**LONG, sp=2, backend="megatron", tp=2)
    with pytest.raises(UserError, match=r"context parallelism.*use Ulysses sequence parallelism \(--sp\)"):
        train(**LONG, cp=2)


def _cli_json(*args: str) -> dict:
    from rlctl.cli.estimate import app

    r = CliRunner().invoke(app, ["memory", "--model", "Qwen2.5-7B", "--method", "grpo", "--gpus", "8", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_cli_activation_line_scales_as_one_over_sp():
    lines = {}
    for sp in (1, 2, 4):
        # the same job at each sp: the plan's other memory choices pinned
        pinned = ("--activation-checkpointing", "--no-offload-activations", "--micro-batch-size", "1")
        d = _cli_json("--max-response-len", "32768", "--sp", str(sp), *pinned, "--json")
        assert d["plan"]["sp"] == d["settings"]["sp"] == sp
        lines[sp] = d["phases"]["training"]["components"]
    for sp in (2, 4):
        assert lines[1]["activations"] == sp * lines[sp]["activations"]
        # the GPU holding the sequence's end: its whole shard is response (32768 of the 33280 positions)
        assert lines[sp]["logits"] == min(-(-T // sp), 32768) * V * (2 + 2 + 4 + 4)
    assert 0 < lines[4]["sp_all_to_all"] < lines[2]["sp_all_to_all"]
