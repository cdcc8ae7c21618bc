"""What the GPU check records to tell G5's causes apart (docs/gpu.md): memory outside torch's allocator at each
step and around the final checkpoint save (rlctl/runtime/cuda_memory.py), and when the sampled nvidia-smi peak
happened beside the job's steps (rlctl/bench/common.ProcessSampler, rlctl/bench/train.peak_timing).

CUDA cannot run here: torch.cuda's memory functions are FAKED (labelled, one fixture) with figures chosen so
that each output is a distinct sum; the nvidia-smi reading is faked the same way, while the sampler's thread and
clock are real."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from rlctl.bench import common
from rlctl.bench.common import ProcessSampler, timeline_points
from rlctl.bench.train import cuda_step_memory, peak_timing
from rlctl.runtime import cuda_memory

GB = 10**9
CUDA = SimpleNamespace(type="cuda")  # a stand-in device: only its type is read before the fakes


@pytest.fixture
def fake_cuda(monkeypatch):
    """FAKE torch.cuda memory API: 80 GB device with 30 GB free; the allocator holds 20 GB (12 allocated,
    1.5 GB of it split and inactive), its peaks 25 / 22 GB, 3 cudaMalloc retries."""
    stats = {
        "allocated_bytes.all.current": 12 * GB,
        "reserved_bytes.all.current": 20 * GB,
        "allocated_bytes.all.peak": 22 * GB,
        "reserved_bytes.all.peak": 25 * GB,
        "inactive_split_bytes.all.current": 3 * GB // 2,
        "num_alloc_retries": 3,
    }
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * GB, 80 * GB))
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20 * GB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 22 * GB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 25 * GB)
    # one process, no process group: the max over ranks is the figures themselves (on the CPU)
    monkeypatch.setattr(cuda_memory, "_max_over_ranks", lambda values, device: list(values))


def test_step_figures_separate_the_allocator_from_the_rest_of_the_device(fake_cuda):
    got = cuda_memory.cuda_memory_peaks(CUDA)
    assert got == {
        "mem/allocated_peak_bytes": 22 * GB,
        "mem/reserved_peak_bytes": 25 * GB,
        "mem/device_used_bytes": 50 * GB,  # 80 total - 30 free
        "mem/outside_torch_bytes": 30 * GB,  # 50 in use - 20 reserved by torch now
    }
    assert cuda_memory.cuda_memory_peaks(torch.device("cpu")) == {}


def test_the_moment_around_a_save_carries_fragmentation_and_retries(fake_cuda):
    got = cuda_memory.cuda_memory_now(CUDA)
    assert got == {
        "allocated_bytes": 12 * GB,
        "reserved_bytes": 20 * GB,
        "allocated_peak_bytes": 22 * GB,
        "reserved_peak_bytes": 25 * GB,
        "device_used_bytes": 50 * GB,
        "outside_torch_bytes": 30 * GB,
        "inactive_split_bytes": 3 * GB // 2,
        "alloc_retries": 3,
    }
    assert cuda_memory.outside_torch(10, 12) == 0  # another process freed memory between the two reads


def test_max_over_ranks_without_a_process_group_is_the_values():
    assert cuda_memory._max_over_ranks([3, 1, 2], torch.device("cpu")) == [3, 1, 2]


def test_the_largest_step_figures_reach_the_result():
    records = [
        {"mem/allocated_peak_bytes": 5, "mem/reserved_peak_bytes": 6, "mem/device_used_bytes": 9},
        {"mem/allocated_peak_bytes": 7, "mem/reserved_peak_bytes": 6, "mem/device_used_bytes": 8},
    ]
    assert cuda_step_memory(records) == {
        "torch_allocated_peak_bytes": 7,
        "torch_reserved_peak_bytes": 6,
        "device_used_at_steps_bytes": 9,
    }
    assert cuda_step_memory([{"loss": 1.0}]) == {}


def test_the_sampled_peak_is_placed_after_the_last_step(monkeypatch):
    """FAKE nvidia-smi: 1 GB in use before the job, then 5, 9 (the steps), 20 (after the last step's record:
    a save), 3. The peak's time comes from the sampler's own clock, compared with the steps' ``time``."""
    readings = iter([1, 5, 9, 9, 20, 3])
    last = {"gpu0": 3 * GB}

    def fake_used():
        try:
            last["gpu0"] = next(readings) * GB
        except StopIteration:
            pass
        return dict(last)

    monkeypatch.setattr(common, "gpu_memory_used", fake_used)
    monkeypatch.setattr(common.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    # FAKE process list: which reading it was taken at
    monkeypatch.setattr(common, "gpu_processes", lambda: [{"pid": 1, "used_bytes": last["gpu0"]}])
    records = []
    with ProcessSampler(lambda cmd: True, gpu=True, interval=0.2) as sampler:
        deadline = time.time() + 5
        while sampler.samples < 3 and time.time() < deadline:  # the steps: 4, 8, 8 GB above the start
            time.sleep(0.05)
        records.append({"step": 1, "time": time.time()})
        while sampler.samples < 5 and time.time() < deadline:
            time.sleep(0.05)
    assert sampler.peak == {"gpu0": 19 * GB}  # less the 1 GB in use before
    timing = peak_timing(records, sampler)
    assert timing["peak_after_last_step_s"] > 0  # after the last step's record
    assert len(timing["step_times_s"]) == 1 and timing["step_times_s"][0] >= 0
    assert max(v for _, v in timing["timeline_gb"]) == 19.0
    assert timing["processes_at_peak"] == [{"pid": 1, "used_bytes": 20 * GB}]  # taken with the peak's sample


def test_the_processes_holding_gpu_memory_are_read_from_nvidia_smi(monkeypatch):
    """FAKE nvidia-smi output (two compute apps and a line it may print without a pid); this process's own pid
    gets its command line."""
    import os

    text = f"{os.getpid()}, python3, 12000\n999999999, python3, 500\nNo running processes found\n"
    monkeypatch.setattr(common.subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=text))
    apps = common.gpu_processes()
    assert [(a["pid"], a["name"], a["used_bytes"]) for a in apps] == [
        (os.getpid(), "python3", 12000 * 2**20),
        (999999999, "python3", 500 * 2**20),
    ]
    assert "pytest" in apps[0]["cmdline"] and "cmdline" not in apps[1]

    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(common.subprocess, "run", missing)
    assert common.gpu_processes() == []


def test_thinning_the_timeline_keeps_the_peak():
    timeline = [(100.0 + i, (i % 7) * GB) for i in range(1000)] + [(1100.0, 99 * GB)]
    points = timeline_points(timeline, start=100.0, most=50)
    assert len(points) <= 50 and max(v for _, v in points) == 99.0 and points[-1] == [1000.0, 99.0]
    assert timeline_points([], start=0.0) == []


def test_the_allocator_history_is_recorded_on_rank_0_of_a_cuda_run_when_asked(monkeypatch, tmp_path):
    """RLCTL_CUDA_MEMORY_SNAPSHOT: torch's recorder FAKED (it needs CUDA); who records, and where it is dumped."""
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("record", k)))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path)))
    monkeypatch.delenv(cuda_memory.SNAPSHOT_ENV, raising=False)
    assert not cuda_memory.start_snapshot(CUDA, 0)  # not asked
    target = str(tmp_path / "sft-megatron.cuda_memory.pickle")
    monkeypatch.setenv(cuda_memory.SNAPSHOT_ENV, target)
    assert not cuda_memory.start_snapshot(CUDA, 1) and not cuda_memory.start_snapshot(torch.device("cpu"), 0)
    assert calls == []
    assert cuda_memory.start_snapshot(CUDA, 0)
    logged = []
    cuda_memory.dump_snapshot(logged.append)
    assert calls == [
        ("record", {"max_entries": cuda_memory.SNAPSHOT_ENTRIES, "stacks": "python"}),
        ("dump", target),
        ("record", {"enabled": None}),  # recording stops
    ]
    assert logged == [f"CUDA memory snapshot: {target}"]
