"""An estimate's JSON form: MemoryEstimate, its Phases and MemorySettings round-trip exactly."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlctl.catalog import resolve_gpu, resolve_model
from rlctl.errors import UserError
from rlctl.estimate import MemoryEstimate, MemorySettings, Phase, estimate_memory

CASES = {
    "grpo-fsdp": ("Qwen2.5-7B", MemorySettings(gpus=8, rollout="sglang")),
    "sft-megatron-pp": ("Qwen2.5-72B", MemorySettings(method="sft", gpus=16, nodes=2, backend="megatron", tp=4, pp=4)),
    "ppo-offload": ("Qwen2.5-14B", MemorySettings(method="ppo", gpus=4, offload_params=True, rollout="vllm")),
    "moe-ep": ("Qwen3-30B-A3B", MemorySettings(method="sft", gpus=8, backend="megatron", ep=8)),
    "cpu-hf-lora": ("Qwen2.5-0.5B", MemorySettings(device="cpu", gpus=2, rollout="hf", lora_rank=8, dtype="fp32")),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_estimate_round_trips_through_json(name):
    model, s = CASES[name]
    est = estimate_memory(resolve_model(model), resolve_gpu("H100-80GB"), s)
    text = json.dumps(est.to_dict())
    back = MemoryEstimate.from_dict(json.loads(text))
    assert back == est and back.settings == s
    assert all(type(p) is Phase for p in [*back.phases.values(), *back.host_phases.values()])
    assert (back.peak_bytes, back.verdict, back.host_bytes) == (est.peak_bytes, est.verdict, est.host_bytes)
    assert json.dumps(back.to_dict()) == text


def test_settings_round_trip_every_field():
    # distinct values in every field, so a swapped or dropped field shows
    s = MemorySettings(**{f.name: f"v{i}" for i, f in enumerate(dataclasses.fields(MemorySettings))})
    assert MemorySettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_odd_keys_are_one_line_errors():
    d = MemorySettings().to_dict()
    for broken, words in (({**d, "zero_stage": 3}, "unknown key 'zero_stage'"), ({}, "missing key 'method'")):
        with pytest.raises(UserError) as e:
            MemorySettings.from_dict(broken)
        assert "\n" not in str(e.value) and words in str(e.value) and "memory settings" in str(e.value)
    with pytest.raises(UserError, match="memory phase: unknown key 'bytes'"):
        Phase.from_dict({"components": {}, "total_bytes": 0, "note": "", "bytes": 1})
