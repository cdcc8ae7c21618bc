"""The FSDP engine's memory options, built on CPU in one process, each measured the way the estimator
counts it: pure bf16 (state bytes), no sharding (FSDP's gather buffers), selective checkpointing
(tensors saved for the backward) and activation offload (activations left on the compute device).

``torch.cuda`` is absent here, so the measurements count tensor bytes directly: parameters,
gradients and optimizer states from the tensors themselves, saved tensors with autograd hooks, and
the layers' outputs still alive after the forward with weak references.
"""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch

from tests.support.sft import chat_rows, cpu_spec, sft_config, write_jsonl

pytestmark = pytest.mark.usefixtures("process_group")  # one gloo rank for the whole module


@pytest.fixture
def cfg(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(4))
    return sft_config(tiny_model_dir, data, tmp_path / "run")


def engine(cfg, **spec):
    from rlctl.engines.fsdp import FSDPEngine

    return FSDPEngine(cpu_spec(cfg, **spec), total_steps=1)


def settings(**kw):
    from rlctl.estimate.memory import MemorySettings

    return MemorySettings(**{"method": "sft", "gpus": 1, "device": "cpu", "dtype": "fp32", "max_len": 24, **kw})


def model_spec(tiny_model_dir):
    from rlctl.catalog.hf_config import spec_from_path

    return spec_from_path(tiny_model_dir)


def batch(t: int = 24):
    torch.manual_seed(0)
    return torch.randint(0, 100, (1, t)), torch.arange(t)[None]


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().logsumexp(-1).mean()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(e) -> dict[str, int]:
    """Bytes of the trained model's weights, gradients and AdamW states, counted from the tensors."""
    params = [p for p in e.model.parameters() if p.requires_grad]
    states = [v for p in params for v in e.optimizer.state[p].values() if torch.is_tensor(v) and v.dim() > 0]
    return {
        "weights": sum(local(p).numel() * local(p).element_size() for p in e.model.parameters()),
        "gradients": sum(local(p.grad).numel() * local(p.grad).element_size() for p in params),
        "optimizer_states": sum(local(v).numel() * local(v).element_size() for v in states),
    }


def grads(e) -> dict[str, torch.Tensor]:
    return {n: local(p.grad).float().clone() for n, p in e.model.named_parameters()}


def test_pure_bf16_halves_the_state_bytes_as_estimated(cfg, tiny_model_dir):
    """Mixed precision keeps fp32 weights, gradients and AdamW m, v (16 bytes/param); pure bf16 keeps
    them in bf16 (8): measured from the tensors after one step, equal to the estimator's counts."""
    from rlctl.estimate.training import job_stages, model_states

    spec = model_spec(tiny_model_dir)
    measured = {}
    for precision in ("mixed", "bf16"):
        e = engine(cfg, dtype="bf16", precision=precision)
        ids, pos = batch()
        e.backward(loss_of(e.forward(ids, pos)))
        e.step()
        # zero_grad(set_to_none) dropped the gradients: one more backward to count them
        e.backward(loss_of(e.forward(ids, pos)))
        measured[precision] = state_bytes(e)
        s = settings(dtype="bf16", precision=precision)
        assert measured[precision] == model_states(spec, s, job_stages(spec, s)[0]), precision
    assert all(measured["bf16"][k] * 2 == measured["mixed"][k] for k in measured["bf16"])
    assert all(p.dtype == torch.bfloat16 for p in engine(cfg, dtype="bf16", precision="bf16").model.parameters())


def test_pure_bf16_needs_bf16_compute(cfg):
    from rlctl.errors import UserError

    with pytest.raises(UserError, match="model.dtype=bf16"):
        engine(cfg, dtype="fp32", precision="bf16")


def gathered_bytes(model) -> int:
    """Bytes of FSDP's unsharded (all-gathered) parameter buffers alive now."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for p in group.fsdp_params:
                    u = getattr(p, "_unsharded_param", None)
                    total += 0 if u is None else u.untyped_storage().nbytes()
    return total


def test_no_sharding_on_one_process_removes_the_gather_buffers(cfg, tiny_model_dir):
    """shard=False: the plain module (no FSDP wrapper, no DTensor), the same gradients, and none of
    the all-gathered copies FSDP keeps after the forward (the root's weights), as the estimator says."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from rlctl.estimate.training import fsdp_buffers

    ids, pos = batch()
    sharded, plain = engine(cfg), engine(cfg, shard=False)
    assert not any(isinstance(m, FSDPModule) for m in plain.model.modules())
    assert not any(isinstance(p, DTensor) for p in plain.model.parameters())
    measured = {}
    for name, e in (("sharded", sharded), ("plain", plain)):
        logits = e.forward(ids, pos)
        measured[name] = gathered_bytes(e.model)
        e.backward(loss_of(logits))
    assert measured["sharded"] > 0 and measured["plain"] == 0
    for n, g in grads(sharded).items():
        assert torch.allclose(g, grads(plain)[n], atol=1e-6, rtol=1e-5), n
    spec = model_spec(tiny_model_dir)
    assert fsdp_buffers(spec, settings()) > 0 and fsdp_buffers(spec, settings(shard=False)) == 0


def test_no_sharding_is_one_process_only(cfg, tmp_path):
    from rlctl.engines.spec import EngineSpec

    spec = EngineSpec.from_config(
        sft_config(
            tmp_path,
            tmp_path / "d.jsonl",
            tmp_path / "o",
            **{
                "parallel__backend": "fsdp",
                "parallel__tp": 1,
                "parallel__pp": 1,
                "parallel__ep": 1,
                "parallel__sp": 1,
                "parallel__sequence_parallel": False,
                "parallel__activation_checkpointing": False,
                "parallel__offload_params": False,
                "parallel__offload_optimizer": False,
                "parallel__shard": False,
                "model__dtype": "fp32",
            },
        )
    )
    assert spec.shard is False and spec.selective_checkpointing is False and spec.precision == "mixed"


def saved_bytes(e, ids, pos) -> tuple[int, torch.Tensor]:
    """Bytes autograd saves for the backward during one forward (outer hooks: what the engine does not
    recompute or move itself), and the logits."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = e.forward(ids, pos)
    return total, logits


def test_selective_checkpointing_saves_less_than_none_and_more_than_full(cfg, tiny_model_dir):
    """Recomputing the MLPs keeps fewer saved tensors than no checkpointing and more than full
    checkpointing, the order the estimator's activation counts give; gradients stay the same."""
    from rlctl.estimate.training import activation_bytes, job_stages

    ids, pos = batch()
    measured, g = {}, {}
    for mode, spec in (
        ("none", {}),
        ("selective", {"selective_checkpointing": True}),
        ("full", {"activation_checkpointing": True}),
    ):
        e = engine(cfg, **spec)
        measured[mode], logits = saved_bytes(e, ids, pos)
        e.backward(loss_of(logits))
        g[mode] = grads(e)
    assert measured["none"] > measured["selective"] > measured["full"]
    for n in g["none"]:
        assert torch.allclose(g["none"][n], g["selective"][n], atol=1e-6, rtol=1e-5), n
    spec = model_spec(tiny_model_dir)
    est = {
        mode: activation_bytes(spec, s, job_stages(spec, s)[0])
        for mode, s in (
            ("none", settings(activation_checkpointing=False)),
            ("selective", settings(activation_checkpointing=False, selective_checkpointing=True)),
            ("full", settings(activation_checkpointing=True)),
        )
    }
    assert est["none"] > est["selective"] > est["full"]


def test_activation_offload_leaves_no_activation_on_the_compute_device(cfg, tiny_model_dir):
    """save_on_cpu keeps host copies of what the backward needs, so the decoder layers' outputs are
    freed after the forward (on a GPU: device memory returned); without it they stay alive. The
    gradients are the same, and the estimate moves the activations to host memory."""
    from rlctl.catalog import resolve_gpu
    from rlctl.estimate.memory import estimate_memory
    from rlctl.estimate.training import activation_bytes, job_stages

    ids, pos = batch()
    alive, g = {}, {}
    for offload in (False, True):
        e = engine(cfg, offload_activations=offload)
        refs: list[weakref.ref] = []
        layers = list(e.model.model.layers)

        def keep(module, args, out, refs=refs):
            refs.append(weakref.ref(out[0] if isinstance(out, tuple) else out))

        hooks = [layer.register_forward_hook(keep) for layer in layers]
        logits = e.forward(ids, pos)
        for h in hooks:
            h.remove()
        assert len(refs) == len(layers)
        alive[offload] = sum(r().numel() * r().element_size() for r in refs if r() is not None)
        e.backward(loss_of(logits))
        g[offload] = grads(e)
    assert alive[False] > 0 and alive[True] == 0
    for n in g[False]:
        assert torch.allclose(g[False][n], g[True][n], atol=1e-6, rtol=1e-5), n
    spec = dataclasses.replace(model_spec(tiny_model_dir), num_layers=8)  # offload keeps ~2 layers' worth
    on, off = (
        settings(activation_checkpointing=False, offload_activations=True),
        settings(activation_checkpointing=False),
    )
    assert activation_bytes(spec, on, job_stages(spec, on)[0]) < activation_bytes(spec, off, job_stages(spec, off)[0])
    gpu = estimate_memory(spec, resolve_gpu("H100"), settings(device="cuda", dtype="bf16", offload_activations=True))
    assert gpu.host_phases["training"].components["offloaded_activations"] > 0


def test_unsharded_mixed_precision_autocasts_like_fsdp(cfg):
    """Without FSDP's MixedPrecisionPolicy the plain module autocasts to bf16 itself: fp32 master
    weights, bf16 logits, and gradients within bf16 rounding of the sharded engine's."""
    ids, pos = batch()
    g = {}
    for shard in (True, False):
        e = engine(cfg, dtype="bf16", shard=shard)
        logits = e.forward(ids, pos)
        assert logits.dtype == torch.bfloat16
        e.backward(loss_of(logits))
        assert all(p.dtype == torch.float32 for p in e.model.parameters())
        g[shard] = grads(e)
    for n in g[True]:
        assert torch.allclose(g[True][n], g[False][n], atol=2e-2, rtol=5e-2), n
