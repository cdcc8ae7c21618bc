"""The host memory of a Megatron checkpoint save (rlctl/estimate/host.py: ``megatron_save_bytes``, the ``save``
host phase): worked out by hand for Qwen2.5-7B, and measured on CPU through the engine's own save.

The measurement (slow, about 40 s on 2 cores): tests/support/scripts/megatron_save_host.py runs a bf16 Qwen2 of
24.4M parameters (2 layers, hidden 512, vocabulary 16384) through ``MegatronEngine.save_checkpoint`` under torchrun
(gloo) at dp 1 and dp 2 and reads each rank's resident set (``VmHWM`` reset around the gather and the write).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlctl.catalog import resolve_gpu, resolve_model
from rlctl.catalog.hf_config import spec_from_path
from rlctl.estimate import MemorySettings, estimate_memory
from rlctl.estimate.host import megatron_save_bytes
from rlctl.estimate.settings import GIB, HOST_PROCESS_BYTES
from rlctl.estimate.training import job_stages

P7 = 7_615_616_512  # Qwen2.5-7B's parameters
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "scripts" / "megatron_save_host.py"
TINY = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 2048,
    "vocab_size": 16384,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
}


def _megatron(**kw) -> MemorySettings:
    return MemorySettings(
        **{"method": "sft", "backend": "megatron", "gpus": 8, "tp": 2, "sequence_parallel": True, **kw}
    )


def test_qwen7b_tp2_on_8_h100_saves_with_every_rank_gathering_its_tp_shard():
    est = estimate_memory(resolve_model("Qwen2.5-7B"), resolve_gpu("H100-80GB"), _megatron())
    # by hand: tp 2 -> u = P/2 parameters per rank (its tp shard, whole over dp 4); all 8 ranks of the node gather
    # at once: 12 bytes per parameter kept (fp32 master, exp_avg, exp_avg_sq) + 12 u the bucket's all-gather
    # (pieces, their concatenation, the previous state's) + 12 u / 4 the rank's own shards
    u = math.ceil(P7 / 2)
    held, gather = 12 * u, 12 * (u + math.ceil(u / 4))
    # the write happens after: only dp rank 0 of each tp pair (ranks 0 and 1) writes: 12 u clones + about 2 u of
    # weights, 2 x 14 u, less than the gather's 8 x 15 u
    save = {k: v for k, v in est.host_phases["save"].components.items() if v}
    assert save == {
        "processes": 8 * HOST_PROCESS_BYTES,
        "save_optimizer_copy": 8 * held,
        "save_gather_buffers": 8 * gather,
    }
    assert save["save_optimizer_copy"] == 365_549_592_576 and save["save_gather_buffers"] == 456_936_990_720
    assert est.host_peak_phase == "save" and est.host_bytes == 96 * u + 120 * u + 32 * GIB
    # the host fit verdict counts it: a node with the training phase's memory but not the save's does not fit
    node = est.host_bytes
    small = estimate_memory(
        resolve_model("Qwen2.5-7B"), resolve_gpu("H100-80GB"), _megatron(host_memory_bytes=int(node / 0.9) - GIB)
    )
    assert small.host_phases["training"].total_bytes < small.host_limit_bytes < small.host_bytes
    assert not small.fits and "the save phase needs" in small.verdict
    assert estimate_memory(
        resolve_model("Qwen2.5-7B"), resolve_gpu("H100-80GB"), _megatron(host_memory_bytes=int(node / 0.9) + GIB)
    ).host_fits


def test_fsdp_has_no_save_phase():
    est = estimate_memory(resolve_model("Qwen2.5-7B"), resolve_gpu("H100-80GB"), MemorySettings(method="sft", gpus=8))
    assert "save" not in est.host_phases and "loading" in est.host_phases


def test_wide_data_parallel_groups_on_one_node_write_more_than_they_gather():
    # ranks are numbered tp first, then dp. tp 4 x dp 16 on 8 nodes: node 0 holds dp ranks 0 and 1 of the tp group,
    # 4 writers of 12 + 2 bytes per parameter against 8 gathering 12 + 12/16: the gather is the peak
    est = estimate_memory(resolve_model("Qwen2.5-7B"), resolve_gpu("H100-80GB"), _megatron(gpus=64, nodes=8, tp=4))
    assert "save_gather_buffers" in est.host_phases["save"].components
    # tp 8 x dp 8: node 0 is the tp group of dp rank 0, 8 writers of 12 + 2 (pinned weights, rounded up) against
    # the gather's 12 + 12/8: the write is the peak
    wide = estimate_memory(resolve_model("Qwen2.5-7B"), resolve_gpu("H100-80GB"), _megatron(gpus=64, nodes=8, tp=8))
    parts = wide.host_phases["save"].components
    assert "save_write_copies" in parts and parts["save_write_copies"] > 8 * 12 * math.ceil(P7 / 8)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_measured_save_matches_the_formula(tmp_path, world):
    pytest.importorskip("megatron.core")
    from rlctl.runtime.net import free_port

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    proc = subprocess.run(
        [*cmd, "--master-port", str(free_port()), str(SCRIPT), str(hf), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    s = MemorySettings(method="sft", backend="megatron", gpus=world, device="cpu", dtype="bf16")
    (stage,) = job_stages(spec_from_path(hf), s)
    want = megatron_save_bytes(s, stage)
    tolerance = 2 * 2**20  # metadata and Python objects; the smallest term (12 u / dp) is 146 MB
    for rank in range(world):
        got = json.loads((out / f"rank{rank}.json").read_text())
        assert got["buffer_numel"] == stage.dense_params and got["dp"] == world
        assert abs(got["held"] - want.held) < tolerance
        assert abs(got["gather_peak"] - want.gather_peak) < tolerance
        write = want.write_peak if got["dp_rank"] == 0 else want.held  # only the main replica writes
        assert abs(got["write_peak"] - write) < tolerance
