"""The planner and Ulysses sequence parallelism: SP when a sequence does not fit otherwise, said why."""

from __future__ import annotations

import io
import re
from dataclasses import replace

import pytest
from rich.console import Console

from rlctl.catalog import resolve_gpu, resolve_model
from rlctl.errors import UserError
from rlctl.estimate import estimate_memory
from rlctl.estimate.settings import GIB
from rlctl.plan import apply_plan, resolve_plan, what_to_rent
from rlctl.plan.render import render_what_to_rent
from rlctl.plan.search import good_fit
from tests.plan.test_plan import LAPTOP, cfg_for

H100 = {"gpus": 8, "gpu": "H100-80GB"}
QWEN_32K = {"model": {"name": "Qwen2.5-7B"}, "hardware": H100, "rollout": {"max_response_len": 32768}}
MISTRAL_64K = {"model": {"name": "Mistral-7B"}, "hardware": H100, "rollout": {"max_response_len": 65536}}


def plan(layers: dict, **more):
    return resolve_plan(cfg_for("grpo", **{**layers, **more}), local=LAPTOP)


def training(model: str, settings):
    return estimate_memory(resolve_model(model), resolve_gpu("H100-80GB"), settings).phases["training"]


def test_a_32k_response_is_planned_with_the_smallest_sp_that_fits_and_says_why():
    # issue 28: rlctl estimate memory --model Qwen2.5-7B --method grpo --gpus 8 --max-response-len 32768
    p = plan(QWEN_32K)
    assert (p.backend, p.sp, p.dp, p.fits) == ("fsdp", 2, 4, True)
    assert not (p.offload_params or p.offload_optimizer or p.offload_activations)  # SP before any offload
    assert p.estimate.settings.sp == 2 and p.decided("parallel")["sp"] == 2
    # under SP the engine runs flash-attn's varlen kernel per document where installed (else sdpa), as at sp 1
    assert p.attn == "flash_attention_2" and p.decided("model.attn") == "flash_attention_2"
    assert any(w.startswith("flash-attn is not installed here") for w in p.warnings)  # LAPTOP has none
    # the numbers in the reason are the estimator's at sp 1 and at sp 2; sp 1 does not fit with the margin
    one = training("Qwen2.5-7B", replace(p.estimate.settings, sp=1))
    assert one.total_bytes > 0.95 * resolve_gpu("H100-80GB").memory_bytes
    two = p.estimate.phases["training"].components
    why = next(d.why for d in p.decisions if d.key == "parallel.sp")
    assert why.startswith(
        f"sp 2 (Ulysses sequence parallelism): at sp 1 a 33280-token micro batch needs "
        f"{one.components['activations'] / GIB:.1f} GiB of activations and {one.components['logits'] / GIB:.1f} "
        f"GiB of logits per GPU, the update {one.total_bytes / GIB:.1f} GiB"
    ), why
    assert f"activations {two['activations'] / GIB:.1f} GiB, logits {two['logits'] / GIB:.1f} GiB" in why
    assert f"all-to-all buffers {two['sp_all_to_all'] / GIB:.1f} GiB" in why
    assert apply_plan(cfg_for("grpo", **QWEN_32K), p).parallel.sp == 2


def test_short_sequences_keep_sp_1_and_say_nothing_about_it():
    p = plan({**QWEN_32K, "rollout": {}})
    assert p.sp == 1 and "sp_all_to_all" not in p.estimate.phases["training"].components
    assert not any(d.key == "parallel.sp" for d in p.decisions)
    assert apply_plan(cfg_for("grpo", **{**QWEN_32K, "rollout": {}}), p).parallel.sp == 1
    # a job that does not fit for its model states, not its sequence: nothing said about SP either
    big = plan({"model": {"name": "Qwen2.5-72B"}, "hardware": {"gpus": 2, "gpu": "L40S-48GB"}})
    assert not big.fits and big.sp == 1 and not any(d.key == "parallel.sp" for d in big.decisions)


def test_when_sp_cannot_make_it_fit_the_plan_says_what_it_would_leave():
    # Qwen2.5-7B, 128k response: sp 4 (the most its 28 heads allow) is not enough; SP is not tried
    p = plan(QWEN_32K, rollout={"max_response_len": 131072})
    assert (p.sp, p.fits) == (1, False)
    why = next(d.why for d in p.decisions if d.key == "parallel.sp")
    top = training("Qwen2.5-7B", replace(p.estimate.settings, sp=4))
    assert why.startswith(
        f"sp 1: splitting each sequence over sp 4 GPUs (the most the heads and a node allow) would still need "
        f"{top.total_bytes / GIB:.1f} GiB for the update"
    ), why


def test_a_configured_sp_is_kept_and_checked():
    four = plan(QWEN_32K, parallel={"sp": 4})
    assert (four.sp, four.dp) == (4, 2) and not any(d.key == "parallel.sp" for d in four.decisions)
    assert "FSDP2 full shard, dp 2 x sp 4:" in next(d.why for d in four.decisions if d.key == "parallel")
    one = plan(QWEN_32K, parallel={"sp": 1})  # without SP every offload is tried, and it does not fit
    assert (one.sp, one.fits, one.offload_params) == (1, False, True)
    with pytest.raises(UserError, match=re.escape("parallel.sp=8: 8 does not divide the 28 attention heads")):
        plan(QWEN_32K, parallel={"sp": 8})
    big = plan({"model": {"name": "Qwen2.5-32B"}, "hardware": H100}, parallel={"sp": 2})  # a Megatron-tier model
    assert (big.backend, big.sp) == ("fsdp", 2)
    assert big.decided("parallel.backend") == "fsdp"
    assert any(r.startswith("backend fsdp: parallel.sp=2 is the FSDP engine's Ulysses") for r in big.reasons)
    flash = plan(QWEN_32K, model={"name": "Qwen2.5-7B", "attn": "flash_attention_2"})
    assert (flash.sp, flash.attn) == (2, "flash_attention_2")  # the engine runs flash-attn's kernel under SP
    eager = plan(QWEN_32K, model={"name": "Qwen2.5-7B", "attn": "eager"})
    assert eager.sp == 1  # the planner does not pick SP where the engine cannot run it (rlctl.support.sp_attn)
    with pytest.raises(UserError, match=re.escape("parallel.sp=2 runs attention per document with flash-attn's")):
        plan(QWEN_32K, model={"name": "Qwen2.5-7B", "attn": "eager"}, parallel={"sp": 2})
    vl = resolve_plan(
        cfg_for("sft", model={"name": "Qwen2.5-VL-7B"}, hardware=H100, train={"max_len": 65536}), local=LAPTOP
    )
    assert vl.sp == 1


def test_sp_stays_inside_a_node():
    # Mistral-7B (32 heads), a 256k response: sp 8 on one node of 8 GPUs; on two nodes of 4, sp 4 at most
    long = {"max_response_len": 262144}
    one_node = plan(MISTRAL_64K, rollout=long)
    two_nodes = plan(MISTRAL_64K, rollout={"max_response_len": 131072}, hardware={**H100, "nodes": 2})
    assert (one_node.sp, one_node.nodes, two_nodes.sp, two_nodes.nodes) == (8, 1, 4, 2)
    assert "dp 2 x sp 4:" in next(d.why for d in two_nodes.decisions if d.key == "parallel")


def test_what_to_rent_considers_sp():
    # SFT of 64k-token sequences: the fewest H100s without offload use SP
    cfg = cfg_for("sft", model={"name": "Mistral-7B"}, train={"max_len": 65536})
    rows = what_to_rent(cfg, local=LAPTOP)
    row = next(r for r in rows if r.gpu == "H100-80GB" and not r.offload)
    assert row.plan.sp > 1 and row.to_dict()["plan"]["sp"] == row.plan.sp and good_fit(row.plan)
    out = io.StringIO()
    render_what_to_rent(Console(file=out, width=200), [row])
    assert f"fsdp dp{row.plan.dp} sp{row.plan.sp}" in out.getvalue()
    at_sp_1 = training("Mistral-7B", replace(row.plan.estimate.settings, sp=1))
    assert at_sp_1.total_bytes > 0.95 * resolve_gpu("H100-80GB").memory_bytes  # SP is what makes it fit there
