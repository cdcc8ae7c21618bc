"""The Plan's JSON form: plans of real configurations survive to_dict -> JSON -> from_dict unchanged;
a dict from elsewhere with an odd key is a one-line UserError; plan.json is written atomically."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from rlctl.config import build_config
from rlctl.errors import UserError
from rlctl.estimate import MemoryEstimate, MemorySettings
from rlctl.plan import LocalEnv, Plan, load_plan, resolve_plan, save_plan
from rlctl.presets import method_layers
from tests.support.cli import REPO

LAPTOP = LocalEnv(gpu_count=0, gpu_name=None, installed=frozenset({"vllm"}), memory_bytes=16 * 2**30)

# (method, layer): every backend, device, rollout engine, LoRA, offload and a plan that does not fit
CASES = {
    "sft-fsdp-cuda": ("sft", {"model": {"name": "Qwen2.5-7B"}, "hardware": {"gpus": 8, "gpu": "H100-80GB"}}),
    "sft-cpu": ("sft", {"model": {"name": "Qwen2.5-0.5B"}, "hardware": {"device": "cpu", "nproc": 2}}),
    "grpo-fsdp-sglang": ("grpo", {"model": {"name": "Qwen2.5-7B"}, "hardware": {"gpus": 8, "gpu": "H100-80GB"}}),
    "grpo-megatron": ("grpo", {"model": {"name": "Qwen2.5-32B"}, "hardware": {"gpus": 8, "gpu": "H100-80GB"}}),
    "grpo-lora-vllm": ("grpo", {"model": {"name": "Qwen2.5-7B"}, "hardware": {"gpus": 1}, "lora": {"rank": 32}}),
    "grpo-cpu-hf": (
        "grpo",
        {"model": {"name": "Qwen2.5-0.5B"}, "hardware": {"device": "cpu"}, "rollout": {"engine": "hf"}},
    ),
    "ppo-fsdp": ("ppo", {"model": {"name": "Qwen2.5-1.5B"}, "hardware": {"gpus": 4, "gpu": "A100-80GB"}}),
    "sft-offload": ("sft", {"model": {"name": "Qwen2.5-72B"}, "hardware": {"gpus": 8, "gpu": "H100-80GB"}}),
    "grpo-long-ulysses": (
        "grpo",
        {"model": {"name": "Mistral-7B"}, "hardware": {"gpus": 8}, "rollout": {"max_response_len": 65536}},
    ),
    "grpo-does-not-fit": ("grpo", {"model": {"name": "Qwen2.5-72B"}, "hardware": {"gpus": 2, "gpu": "L40S-48GB"}}),
}


def plan_of(name: str) -> Plan:
    method, layer = CASES[name]
    return resolve_plan(build_config(method, method_layers(method, None) + [layer]), local=LAPTOP)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: plan_of(name) for name in CASES}


def test_the_cases_cover_what_a_plan_can_be(plans):
    # the round trip below is only as good as the variety of plans it sees
    got = {(p.method, p.backend, p.device, p.rollout, p.lora_rank > 0) for p in plans.values()}
    assert {m for m, *_ in got} == {"sft", "grpo", "ppo"}
    assert {b for _, b, *_ in got} == {"fsdp", "megatron"}
    assert {d for _, _, d, *_ in got} == {"cuda", "cpu"}
    assert {"hf", "vllm", "sglang", None} <= {r for *_, r, _ in got}
    assert any(lora for *_, lora in got)
    assert any(p.offload_params or p.offload_optimizer for p in plans.values())
    assert any(not p.fits for p in plans.values())
    assert any(p.sp > 1 for p in plans.values())  # Ulysses sequence parallelism, with its all-to-all line
    assert all(p.estimate.host_phases for p in plans.values() if p.device == "cuda")


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_round_trips_through_json(plans, name):
    plan = plans[name]
    text = json.dumps(plan.to_dict())  # plain JSON: no objects left inside
    back = Plan.from_dict(json.loads(text))
    assert back == plan
    assert type(back.estimate) is MemoryEstimate and type(back.estimate.settings) is MemorySettings
    # the derived numbers of the estimate come out the same, and so does the JSON
    for key in ("peak_phase", "peak_bytes", "headroom_bytes", "fits", "verdict", "host_bytes", "host_fits"):
        assert getattr(back.estimate, key) == getattr(plan.estimate, key), key
    assert json.dumps(back.to_dict()) == text


def test_round_trip_keeps_each_field_by_name(plans):
    # equality alone would miss a from_dict that swaps two fields of equal value: make every int distinct
    d = plans["grpo-megatron"].to_dict()
    settings = d["estimate"]["settings"]
    ints = [k for k, v in settings.items() if isinstance(v, int) and not isinstance(v, bool)]
    for i, key in enumerate(ints):
        settings[key] = 1000 + i
    top = ("tp", "pp", "dp", "cp", "ep", "sp", "rollout_tp", "micro_batch_size", "gpus", "nodes", "lora_rank")
    for i, key in enumerate(top):
        d[key] = 100 + i
    back = Plan.from_dict(json.loads(json.dumps(d)))
    assert len(ints) >= 15
    assert [getattr(back.estimate.settings, k) for k in ints] == [1000 + i for i in range(len(ints))]
    assert [getattr(back, k) for k in top] == [100 + i for i in range(len(top))]


def _one_line_error(d: dict, *words: str) -> None:
    with pytest.raises(UserError) as e:
        Plan.from_dict(d)
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


@pytest.mark.parametrize(
    "where",
    [(), ("estimate",), ("estimate", "settings"), ("estimate", "phases", "training")],
    ids=["plan", "estimate", "settings", "phase"],
)
def test_from_dict_rejects_an_unknown_or_a_missing_key(plans, where):
    def inner(d: dict) -> dict:
        for key in where:
            d = d[key]
        return d

    d = json.loads(json.dumps(plans["grpo-fsdp-sglang"].to_dict()))
    inner(d)["tensor_parallel"] = 2
    _one_line_error(d, "unknown key 'tensor_parallel'")

    d = json.loads(json.dumps(plans["grpo-fsdp-sglang"].to_dict()))
    first = next(iter(inner(d)))
    del inner(d)[first]
    _one_line_error(d, f"missing key {first!r}")


def test_from_dict_rejects_what_is_not_an_object():
    _one_line_error([1, 2], "expected a JSON object", "list")


def test_save_and_load_plan(plans, tmp_path):
    path = tmp_path / "run" / "plan.json"
    save_plan(plans["grpo-megatron"], path)
    assert load_plan(path) == plans["grpo-megatron"]
    assert json.loads(path.read_text())["backend"] == "megatron"
    save_plan(plans["sft-cpu"], path)  # replaces the old plan
    assert load_plan(path) == plans["sft-cpu"]
    assert [p.name for p in path.parent.iterdir()] == ["plan.json"]  # no temporary file left


def test_save_plan_is_atomic(plans, tmp_path):
    path = tmp_path / "plan.json"
    save_plan(plans["sft-cpu"], path)
    before = path.read_text()
    broken = dataclasses.replace(plans["grpo-megatron"], warnings=[object()])  # not JSON
    with pytest.raises(TypeError):
        save_plan(broken, path)
    assert path.read_text() == before  # the old plan is whole
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_load_plan_errors_are_one_line(plans, tmp_path):
    for path, words in (
        (tmp_path / "missing.json", ("no plan at", "missing.json")),
        (tmp_path / "bad.json", ("cannot read the plan", "bad.json")),
        (tmp_path / "odd.json", ("odd.json", "unknown key 'extra'")),
    ):
        if path.name == "bad.json":
            path.write_text('{"method": ')
        if path.name == "odd.json":
            path.write_text(json.dumps({**plans["sft-cpu"].to_dict(), "extra": 1}))
        with pytest.raises(UserError) as e:
            load_plan(path)
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_plan_types_import_no_torch():
    code = (
        "import sys; import rlctl.plan.types as t; from rlctl.plan import load_plan; "
        "bad = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
