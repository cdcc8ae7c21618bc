"""The planner and Ulysses sequence parallelism: SP when a sequence does not fit otherwise, said why."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from rlctl.catalog import resolve_gpu, resolve_model
from rlctl.errors import UserError
from rlctl.estimate import estimate_memory
from rlctl.estimate.settings import GIB
from rlctl.plan import apply_plan, resolve_plan, what_to_rent
from rlctl.plan.planner import good_fit
from tests.plan.test_plan import LAPTOP, cfg_for

LONG = {"model": {"name": "Qwen2.5-7B"}, "hardware": {"gpus": 8, "gpu": "H100-80GB"}}
RESPONSE_32K = {"max_response_len": 32768}


def long_plan(**sections):
    layers = {**LONG, "rollout": RESPONSE_32K, **sections}
    return resolve_plan(cfg_for("grpo", **layers), local=LAPTOP)


def test_a_32k_response_is_planned_with_the_smallest_sp_that_fits_and_says_why():
    p = long_plan()
    assert (p.backend, p.sp, p.dp, p.fits) == ("fsdp", 2, 4, True)
    assert not (p.offload_params or p.offload_optimizer or p.offload_activations)  # SP before any offload
    s = p.estimate.settings
    assert s.sp == 2 and p.decided("parallel")["sp"] == 2
    why = next(d.why for d in p.decisions if d.key == "parallel.sp")
    # the numbers in the reason are the estimator's at sp 1 and at sp 2
    gpu, model = resolve_gpu("H100-80GB"), resolve_model("Qwen2.5-7B")
    one = estimate_memory(model, gpu, replace(s, sp=1)).phases["training"]
    two = p.estimate.phases["training"].components
    assert one.total_bytes > gpu.memory_bytes * 0.95  # sp 1 does not fit with the margin
    expected = (
        f"sp 2 (Ulysses sequence parallelism): at sp 1 a 33280-token micro batch needs "
        f"{one.components['activations'] / GIB:.1f} GiB of activations and {one.components['logits'] / GIB:.1f} "
        f"GiB of logits per GPU"
    )
    assert why.startswith(expected), why
    assert f"logits {two['logits'] / GIB:.1f} GiB, all-to-all buffers {two['sp_all_to_all'] / GIB:.1f} GiB" in why
    assert apply_plan(cfg_for("grpo", **LONG, rollout=RESPONSE_32K), p).parallel.sp == 2


def test_short_sequences_keep_sp_1_and_say_nothing_about_it():
    p = resolve_plan(cfg_for("grpo", **LONG), local=LAPTOP)
    assert p.sp == 1 and "sp_all_to_all" not in p.estimate.phases["training"].components
    assert not any(d.key == "parallel.sp" for d in p.decisions)


def test_a_configured_sp_is_kept_and_sp_1_falls_back_to_offload():
    four = long_plan(parallel={"sp": 4})
    assert four.sp == 4 and four.dp == 2 and not any(d.key == "parallel.sp" for d in four.decisions)
    assert "FSDP2 full shard, dp 2 x sp 4:" in next(d.why for d in four.decisions if d.key == "parallel")
    assert four.fits and four.estimate.phases["training"].components["logits"] == 33280 // 4 * 152064 * 12
    one = long_plan(parallel={"sp": 1})  # without SP every offload is tried, and the logits still do not fit
    assert (one.sp, one.fits, one.offload_params, one.offload_activations) == (1, False, True, True)


def test_sp_sizes_respect_the_heads_and_the_node():
    # a 64k response: sp 2 is not enough, and sp 4 the largest Qwen2.5-7B's 28 heads allow (sp 1, 2, 4 tried)
    p = long_plan(rollout={"max_response_len": 65536})
    assert (p.sp, p.fits) == (4, True)
    assert "(the closest of 3 layouts)" in next(d.why for d in p.decisions if d.key == "rejected")
    two = estimate_memory(resolve_model("Qwen2.5-7B"), resolve_gpu("H100-80GB"), replace(p.estimate.settings, sp=2))
    assert two.phases["training"].total_bytes > two.gpu_memory_bytes * 0.95
    # a 128k response does not fit at sp 4 either: SP is not what makes the difference, so not tried
    far = long_plan(rollout={"max_response_len": 131072})
    assert (far.sp, far.fits) == (1, False) and not any(d.key == "parallel.sp" for d in far.decisions)
    # on 2 GPUs per node, sp 2 is the largest tried
    two_gpus = {**LONG, "hardware": {"gpus": 2, "gpu": "H100-80GB"}}
    small = resolve_plan(cfg_for("grpo", **two_gpus, rollout=RESPONSE_32K), local=LAPTOP)
    assert small.sp == small.estimate.settings.sp == 2
    assert "dp 1 x sp 2:" in next(d.why for d in small.decisions if d.key == "parallel")
    assert small.offload_params  # the states of 7.6B parameters need the CPU on 2 GPUs; sp 2 the sequence
    with pytest.raises(UserError, match=re.escape("parallel.sp=8: 8 does not divide the 28 attention heads")):
        long_plan(parallel={"sp": 8})


def test_what_to_rent_considers_sp():
    cfg = cfg_for("grpo", model={"name": "Qwen2.5-7B"}, rollout=RESPONSE_32K)
    rows = [r for r in what_to_rent(cfg, local=LAPTOP) if r.plan is not None and r.gpu == "H100-80GB"]
    assert rows and all(good_fit(r.plan) for r in rows)
    no_offload = next(r for r in rows if not r.offload)
    assert no_offload.plan.sp > 1 and no_offload.to_dict()["plan"]["sp"] == no_offload.plan.sp
