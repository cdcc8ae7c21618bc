"""GPU faults found by reading vLLM 0.32, SGLang 0.5.23, torch's c10d and rlctl's offload code (issue 35).

No GPU here. Each test runs rlctl's own code with the boundary that cannot run on this machine faked and
labelled FAKE, and, where the library is installed, calls the library's own function (vLLM's
``request_memory``). Each failed before its fix.
"""

from __future__ import annotations

import re
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

GIB = 2**30


# ---------------------------------------------------------------------------------------------
# 1. A split run's evaluation engine on the trainer GPUs


def _split_run_config():
    """Qwen2.5-7B GRPO on 8 H100s, 2 of them rollout-only, vLLM, evaluated before training."""
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.plan import apply_plan
    from rlctl.plan.inputs import LocalEnv
    from rlctl.plan.planner import plan_config
    from rlctl.presets import method_layers

    sets = {
        "model.name": "Qwen2.5-7B",
        "hardware.device": "cuda",
        "hardware.gpus": 8,
        "hardware.gpu": "H100",
        "rollout.engine": "vllm",
        "rollout.procs": 2,
        "train.eval_before": True,
    }
    cfg = build_config("grpo", method_layers("grpo", None) + [dotted_to_nested(sets)])
    plan = plan_config(cfg, LocalEnv(installed=frozenset({"vllm"})))
    return apply_plan(cfg, plan), plan


def test_split_run_evaluation_engine_fits_beside_the_trainer(monkeypatch):
    """Evaluation in a one-step-off-policy run builds a rollout engine on every TRAINER GPU. It took the
    rollout GPUs' fraction (0.85: nothing else lives there), but a trainer GPU holds the trainer's weights,
    optimizer states and reference model: vLLM's own ``request_memory`` refuses to start when less than
    ``fraction x total`` is free. The plan now records a fraction for that engine, derived from the same
    estimate, and the trainer's evaluation engine gets it (the rollout processes keep theirs).
    (FAKE: the engine constructor is recorded; vLLM's memory snapshot is a record of total and free bytes.)"""
    from vllm.config import CacheConfig
    from vllm.v1.worker.utils import request_memory

    from rlctl.recipes.rl.rollouts import make_engine
    from rlctl.rollout import RolloutSpec

    cfg, plan = _split_run_config()
    assert cfg.rollout.mem_fraction == plan.rollout_mem_fraction >= 0.8  # the rollout GPUs hold the engine alone
    built = []
    monkeypatch.setattr("rlctl.rollout.make_rollout_engine", built.append)
    d = SimpleNamespace(rank=0, world_size=6, local_rank=0, local_world_size=6)
    # a split run's trainer: its samples come from the rollout processes, its engine evaluates only
    device = torch.device("cuda", 0)
    run_spec = RolloutSpec.from_config(cfg).replace(model_path="/model")  # as rlctl.recipes.rl.inputs builds it
    make_engine(cfg, d, run_spec, device=device, dtype="bf16", evaluation_only=True, log=lambda line: None)
    (spec,) = built
    # what the trainer holds on its GPU while it evaluates, from the estimate's training phase
    parts = plan.estimate.phases["training"].components
    held = sum(parts[k] for k in ("weights", "optimizer_states", "reference_model", "cuda_context"))
    total = plan.estimate.gpu_memory_bytes
    assert held > 0.15 * total
    snapshot = SimpleNamespace(total_memory=total, free_memory=total - held, device_="cuda:0")
    request_memory(snapshot, CacheConfig(gpu_memory_utilization=spec.mem_fraction))  # vLLM starts
    with pytest.raises(ValueError, match="less than desired GPU memory utilization"):
        # the rollout GPUs' fraction (what the trainer's engine got before) on the same GPU
        request_memory(snapshot, CacheConfig(gpu_memory_utilization=RolloutSpec.from_config(cfg).mem_fraction))
    assert 0 < spec.mem_fraction == cfg.rollout.eval_mem_fraction == plan.rollout_eval_mem_fraction
    assert any(d.key == "rollout.eval_mem_fraction" for d in plan.decisions)


# ---------------------------------------------------------------------------------------------
# 2. The off-policy weight-sync NCCL group: its timeout, its end


class _FakeNCCL:
    """FAKE (this CPU build of torch has no ProcessGroupNCCL): records its construction and its end."""

    made: list[_FakeNCCL] = []
    ended: list[str] = []

    class Options:
        _timeout = timedelta(minutes=10)  # NCCL's default (torch c10d: kProcessGroupNCCLDefaultTimeout)
        is_high_priority_stream = True

    def __init__(self, store, rank, size, options=None):
        self.rank, self.size, self.options = rank, size, options
        _FakeNCCL.made.append(self)

    def shutdown(self):
        _FakeNCCL.ended.append("sync")


class _FakeGloo:
    """FAKE: the bridge's gloo group (a real one would wait for the other processes to connect)."""

    def __init__(self, store, rank, size, timeout):
        self.timeout = timeout

    def shutdown(self):
        _FakeNCCL.ended.append("bridge")


@pytest.mark.parametrize("rank", [0, 2])  # trainer 0 and the rollout process of a 2 + 1 split
def test_split_weight_sync_group_waits_the_run_timeout_and_is_destroyed(monkeypatch, rank):
    """The sync group (trainer 0 and the rollout processes, NCCL on CUDA) was built by its constructor
    without options: NCCL's 10-minute watchdog then kills a rollout process that waits through a longer
    update (or trainer 0 through a longer rollout), though every other group waits 30 minutes. It now gets
    ``hardware.collective_timeout_min`` like the others, the way torch's ``new_group`` sets it
    (``options._timeout``), and it and the bridge are ended at the end of the run (``destroy_process_group``
    does not know groups it did not register). (FAKE: the rendezvous, the default group's init, the gloo
    bridge and the NCCL class are recorded.)"""
    import torch.distributed as dist

    from rlctl.runtime import dist as rdist

    _FakeNCCL.made.clear()
    _FakeNCCL.ended.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "rendezvous", lambda url: iter([(dist.HashStore(), rank, 3)]))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: None)
    monkeypatch.setattr(dist, "ProcessGroupGloo", _FakeGloo, raising=False)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", _FakeNCCL, raising=False)
    for key, value in {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank)}.items():
        monkeypatch.setenv(key, value)
    d = rdist.init_distributed("cuda", rollout_procs=1, timeout=timedelta(minutes=45))
    (sync,) = _FakeNCCL.made
    assert d.split.sync is sync and sync.size == 2 and sync.rank == (0 if rank == 0 else 1)
    assert sync.options is not None and sync.options._timeout == timedelta(minutes=45)
    assert d.split.bridge.timeout == timedelta(minutes=45)
    rdist.destroy_all()
    assert _FakeNCCL.ended == ["sync", "bridge"]
    rdist.destroy_all()  # nothing left to end
    assert _FakeNCCL.ended == ["sync", "bridge"]


def test_collective_timeout_is_a_checked_setting():
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.errors import UserError
    from rlctl.presets import method_layers

    assert build_config("grpo", method_layers("grpo", None)).hardware.collective_timeout_min == 30
    with pytest.raises(UserError, match="hardware.collective_timeout_min must be at least 1"):
        build_config("grpo", method_layers("grpo", None) + [dotted_to_nested({"hardware.collective_timeout_min": 0})])


# ---------------------------------------------------------------------------------------------
# 3. Dynamic sampling and evaluation: one weight sync while nothing changed


class _VLLMLike:
    """A rollout engine that behaves as vLLM on a GPU does (FAKE: it generates fixed tokens): sleep frees
    the KV cache and DISCARDS the weights (level 2), so every wake after a sleep needs a full weight sync.
    Records each sync and each sleep."""

    @staticmethod
    def make():
        from rlctl.rollout.base import RolloutEngine, Sample

        class Engine(RolloutEngine):
            name = "vllm-like"
            supports_sleep = True
            keeps_weights_asleep = False

            def __init__(self):
                self.events: list[str] = []

            def _generate(self, prompts, n, sampling):
                return [Sample(i, [5 + j, 2], [-0.5, -0.1], "stop") for i in range(len(prompts)) for j in range(n)]

            def _load_weights(self, named_tensors):
                self.events.append(f"sync {len(list(named_tensors))} tensors")

            def _release(self, tags):
                self.events.append("sleep")

            def _resume(self, tags):
                pass

            def close(self):
                pass

        return Engine()


def _sampling_part(*, val_n: int):
    """The trainer's Sampling part, with rlctl's own sampling, dynamic sampling, evaluation and weights
    bookkeeping; FAKE: the engine (_VLLMLike), the actor's all-gather (counted) and the scores (every group
    equal, so dynamic sampling runs all its rounds)."""
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.data.rl import Prompt
    from rlctl.presets import method_layers
    from rlctl.recipes.rl.rollouts import ActorWeights, ColocatedRollout
    from rlctl.recipes.rl.sampling import Sampling
    from rlctl.recipes.rl.stream import PromptStream
    from rlctl.recipes.rl.turns import SingleTurn

    sets = {
        "train.batch_size": 2,
        "rollout.n": 2,
        "rollout.val_n": val_n,
        "rollout.max_response_len": 4,
        "algo.dynamic_sampling": True,
        "algo.dynamic_max_rounds": 3,
        "data.shuffle": False,
    }
    cfg = build_config("grpo", method_layers("grpo", None) + [dotted_to_nested(sets)])
    gathers = []

    class Actor:
        def iter_full_params(self, dtype):
            gathers.append(dtype)  # FAKE: FSDP's all-gather of every parameter
            return iter([("w", torch.zeros(2)), ("b", torch.zeros(1))])

    class Scorer:  # FAKE: every sample scores 0, so no group varies
        def score_batch(self, batch, step, turns):
            return torch.zeros(len(batch)), {"reward/mean": 0.0}

        def score(self, prompt_ids, token_ids, prompts, step, trajectories):
            return torch.zeros(len(token_ids)), {"reward/mean": 0.0}

    prompts = [Prompt([3, 4 + i], "arith", str(i), None) for i in range(16)]
    data = SimpleNamespace(train=prompts, val=prompts[:3])
    weights = ActorWeights(Actor(), "fp32")
    engine = _VLLMLike.make()
    turns = SingleTurn()
    own = ColocatedRollout(lambda: None, weights, cfg, rank=0, world_size=1, tp=1, turns=turns, engine=engine)
    sampling = Sampling(
        cfg, data, PromptStream(cfg, len(prompts)), own, own, Scorer(), rank=0, world_size=1,
        device=torch.device("cpu"), turns=turns, needs_greedy=False, log=lambda line: None,
    )  # fmt: skip
    return sampling, weights, engine, gathers


def test_dynamic_sampling_and_evaluation_sync_the_weights_once():
    """Dynamic sampling woke the engine, synced the actor's weights into it and put it to sleep on every
    round, with no update in between: on vLLM and SGLang a sleep discards the weights, so each extra round
    paid a full all-gather and reload. Evaluation with ``val_n > 1`` did the same for its second pass. The
    engine now stays awake through the rounds and the passes, and syncs only when the actor's weights
    version moved (or it dropped its weights asleep)."""
    rl, weights, engine, gathers = _sampling_part(val_n=4)
    batch, metrics = rl.sample(0)
    assert metrics["dynamic/rounds"] == 3.0
    assert len(gathers) == 0 and engine.events == ["sleep"]  # the engine holds the initial weights
    weights.stepped()  # the actor's update (RLTrainer.update_actor)
    rl.sample(1)
    assert len(gathers) == 1 and engine.events == ["sleep", "sync 2 tensors", "sleep"]
    out = rl.evaluate(2)  # two passes (val_n 4): asleep since the last step, so one sync
    assert "val/pass@4" in out and len(gathers) == 2
    assert engine.events[-2:] == ["sync 2 tensors", "sleep"]
    rl.sample(2)  # no update since the evaluation, but vLLM dropped the weights asleep: one sync
    assert len(gathers) == 3 and engine.events[-2:] == ["sync 2 tensors", "sleep"]


# ---------------------------------------------------------------------------------------------
# 4. Activation offload: no parameters, and no blocking copy on CUDA


def test_activation_offload_copies_activations_not_parameters(tiny_model_dir):
    """Activation offload copied every tensor autograd saves, the weights every linear layer saves
    included (about the model's bytes to the host and back per micro-batch, for tensors the module holds
    anyway). It now copies exactly the saved tensors that are not parameters (counted independently by a
    plain recorder of the same forward), and the gradients are those of the run without offload."""
    from transformers import AutoModelForCausalLM

    from rlctl.engines.savers import HostActivations

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    ids = torch.randint(4, 300, (2, 12), generator=torch.Generator().manual_seed(0))

    def grads_of(hooks) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with hooks:
            loss = model(input_ids=ids).logits.float().pow(2).mean()
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    saved: list[torch.Tensor] = []
    want = grads_of(torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t))
    params = {id(p) for p in model.parameters()}
    param_bytes = sum(t.nbytes for t in saved if id(t) in params)
    activation_bytes = sum(t.nbytes for t in saved if id(t) not in params)
    assert param_bytes > 0 and activation_bytes > 0  # the linear layers save their weights

    offload = HostActivations(torch.device("cpu"))
    packed: list = []
    pack = offload.pack_hook
    offload.pack_hook = lambda t: packed.append(pack(t)) or packed[-1]
    got = grads_of(offload)
    copied = [p[1] for p in packed if isinstance(p, tuple)]
    kept = [p for p in packed if not isinstance(p, tuple)]
    assert sum(h.nbytes for h in copied) == activation_bytes
    assert kept and all(id(p) in params for p in kept)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7)


class _FakeCudaStreams:
    """FAKE torch.cuda stream API (no GPU here): records, in order, what each call would do on a GPU."""

    def __init__(self, monkeypatch):
        self.log: list[str] = []
        log = self.log

        class Stream:
            def __init__(self, device=None, name="side"):
                self.name = name

            def wait_stream(self, other):
                log.append(f"{self.name} waits for {other.name}")

            def wait_event(self, event):
                log.append(f"{self.name} waits for {event.name}")

        class Event:
            def __init__(self):
                self.name = "copy event"

            def record(self, stream):
                log.append(f"{self.name} recorded on {stream.name}")

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                log.append(f"enter {self.stream.name}")

            def __exit__(self, *exc):
                log.append(f"leave {self.stream.name}")

        empty = torch.empty

        def pinned_empty(*size, pin_memory=False, **kw):
            log.append(f"host buffer pinned={pin_memory}")
            return empty(*size, **kw)

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", StreamContext)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(name="compute"))
        monkeypatch.setattr(torch, "empty", pinned_empty)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: log.append(f"tensor kept for {s.name}"))


def test_activation_offload_copies_on_a_side_stream_into_pinned_memory(monkeypatch):
    """On CUDA each saved activation was copied to pageable host memory with a blocking copy: the forward
    waited for PCIe on every tensor. The copy now runs non-blocking on a side stream into pinned memory,
    after the work that wrote the tensor; the tensor is kept alive for that stream, and the backward's
    stream waits for the copy's event before bringing it back. (FAKE: torch.cuda's streams and events
    record their calls; the tensors are CPU tensors.)"""
    from rlctl.engines.savers import SideStreamCopies

    fake = _FakeCudaStreams(monkeypatch)
    copies = SideStreamCopies(torch.device("cuda", 0))
    t = torch.randn(3, 5)
    device, host, copied = copies.to_host(t)
    assert fake.log == [
        "host buffer pinned=True",
        "side waits for compute",
        "enter side",
        "copy event recorded on side",
        "leave side",
        "tensor kept for side",
    ]
    assert torch.equal(host, t) and host.data_ptr() != t.data_ptr()
    fake.log.clear()
    back = copies.to_device(host, device, copied)
    assert fake.log == ["compute waits for copy event"] and torch.equal(back, t)


# ---------------------------------------------------------------------------------------------
# 5. Per-document attention: a few batched calls (or flash-attn's varlen kernel), not one per block


_VIEW_OPS = ("aten.view", "aten.transpose", "aten._unsafe_view", "aten.expand", "aten.slice.", "aten.select")
_VIEW_OPS += ("aten.detach", "aten.alias", "aten.unsqueeze", "aten.t.", "aten.permute", "aten.squeeze")


class _Allocations(TorchDispatchMode):
    """The bytes of the tensors the ops under it create (views excluded), and how many of them have the
    size of a whole input (``full_sizes``: numels)."""

    def __init__(self, full_sizes: set[int]):
        super().__init__()
        self.full_sizes, self.bytes, self.full = full_sizes, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not str(func).startswith(_VIEW_OPS):
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.bytes += t.nbytes
                    self.full += t.numel() in self.full_sizes
        return out


def _packed_blocks(lengths: list[int], prefix: int = 0) -> tuple[list, int]:
    """Blocks of one row: a prompt of ``prefix`` tokens (when > 0) that every block after it answers."""
    blocks, at = ([(0, 0, prefix, 0, 0)], prefix) if prefix else ([], 0)
    for n in lengths:
        blocks.append((0, at, at + n, 0, prefix))
        at += n
    return blocks, at


def _by_hand(q, k, v, blocks, scale):
    """Each block alone, softmax written out (repeat the KV heads; the prefix then causal)."""
    kk, vv = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    out = torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
    for row, start, end, p0, p1 in blocks:
        keys = torch.cat([kk[row, :, p0:p1], kk[row, :, start:end]], 1)
        values = torch.cat([vv[row, :, p0:p1], vv[row, :, start:end]], 1)
        scores = q[row, :, start:end] @ keys.transpose(-1, -2) * scale
        n = end - start
        allowed = torch.ones(n, p1 - p0 + n, dtype=torch.bool)
        allowed[:, p1 - p0 :] = torch.ones(n, n, dtype=torch.bool).tril()
        out[row, start:end] = (scores.masked_fill(~allowed, -torch.inf).softmax(-1) @ values).transpose(0, 1)
    return out


def test_per_document_attention_is_batched_and_its_backward_allocates_no_tensor_per_block(monkeypatch):
    """Per-document attention ran one sdpa call per block and layer from Python, and each block's slices of
    q, k and v allocated a full-size zero tensor in the backward: the backward's allocations grew with the
    number of blocks (32 documents: 64 x the bytes of q, k, v; 64 documents: 128 x). The blocks are now
    gathered by index: sdpa runs once per bucket of similar lengths (1 call for the documents, 2 with a
    shared prompt), and the backward allocates the same few full-size tensors whatever the block count.
    The values and gradients equal each block computed alone by hand."""
    from rlctl.engines import varlen

    calls = []
    sdpa = varlen.F.scaled_dot_product_attention
    monkeypatch.setattr(varlen.F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    g = torch.Generator().manual_seed(0)
    for prefix, buckets in ((0, 1), (6, 2)):  # packed documents; a prompt and the responses that share it
        measured = []
        for copies in (4, 8):  # 32 and 64 blocks
            blocks, length = _packed_blocks([5, 9, 3, 12, 7, 6, 4, 10] * copies, prefix)
            q, k, v = (torch.randn(1, h, length, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
            calls.clear()
            out, _ = varlen.attention(None, q, k, v, None, scaling=0.25, rlctl_blocks=blocks)
            assert len(calls) == buckets
            grad = torch.randn(out.shape, generator=g)
            counted = _Allocations({q.numel(), k.numel()})
            with counted:
                out.backward(grad)
            measured.append((counted.full, counted.bytes / (q.nbytes + k.nbytes + v.nbytes)))
            got = [x.grad.clone() for x in (q, k, v)]
            for x in (q, k, v):
                x.grad = None
            want = _by_hand(q, k, v, blocks, 0.25)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
            want.backward(grad)
            for a, x in zip(got, (q, k, v)):
                torch.testing.assert_close(a, x.grad, rtol=1e-4, atol=1e-5)
        (full_32, ratio_32), (full_64, ratio_64) = measured
        assert full_64 == full_32 < 32  # the full-size tensors do not grow with the blocks
        assert ratio_64 == pytest.approx(ratio_32, rel=0.05) and ratio_64 < 16


def _fake_flash_varlen(calls: list):
    """FAKE flash_attn.flash_attn_varlen_func (flash-attn needs CUDA): its documented semantics, one sequence
    at a time: queries ``cu_q[i]:cu_q[i+1]`` see keys ``cu_k[i]:cu_k[i+1]``, causal aligned bottom-right
    (query t of n sees keys up to t + m - n), grouped KV heads."""

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        calls.append({"sequences": len(cu_q) - 1, "max_q": max_q, "max_k": max_k, "causal": causal})
        outs = []
        for i in range(len(cu_q) - 1):
            qs, ks, vs = q[cu_q[i] : cu_q[i + 1]], k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]
            n, m = qs.shape[0], ks.shape[0]
            ks, vs = (x.repeat_interleave(qs.shape[1] // x.shape[1], 1) for x in (ks, vs))
            scores = torch.einsum("qhd,khd->hqk", qs, ks) * softmax_scale
            allowed = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n)
            outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, -torch.inf).softmax(-1), vs))
        return torch.cat(outs)

    return kernel


def test_per_document_attention_uses_flash_varlen_in_one_call(monkeypatch):
    """Where flash-attn is installed (on CUDA) the blocks go to its varlen kernel in ONE call per layer,
    with cu_seqlens (the shared prompt's keys before each response's own); same values as by hand.
    (FAKE: the kernel, flash-attn's documented semantics in torch.)"""
    from rlctl.engines import varlen

    calls = []
    monkeypatch.setattr(varlen, "flash_varlen", lambda: _fake_flash_varlen(calls))
    blocks, length = _packed_blocks([5, 9, 3, 12], prefix=6)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, length, 16, generator=g) for h in (4, 2, 2))
    out, _ = varlen.attention(None, q, k, v, None, scaling=0.25, rlctl_blocks=blocks, rlctl_flash=True)
    assert calls == [{"sequences": 5, "max_q": 12, "max_k": 18, "causal": True}]
    torch.testing.assert_close(out, _by_hand(q, k, v, blocks, 0.25), rtol=1e-5, atol=1e-6)


def test_sequence_parallel_attention_takes_flash_attn_where_installed(monkeypatch, process_group):
    """Ulysses SP forced sdpa even where flash-attn is installed (and refused model.attn=flash_attention_2):
    its per-document attention now takes flash-attn's varlen kernel on CUDA where flash-attn is installed,
    and the forward tells the attention so. (FAKE: flash-attn "installed", a CUDA device named, the kernel.)"""
    import importlib.util

    from rlctl.engines import ulysses, varlen
    from rlctl.engines.dims import sp_grid
    from rlctl.engines.fsdp import FSDPEngine
    from rlctl.engines.spec import EngineSpec

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else find_spec(name, *a)
    )
    cuda = SimpleNamespace(device=torch.device("cuda", 0))
    for attn in (None, "flash_attention_2"):
        assert FSDPEngine._attn(cuda, EngineSpec(sp=2, attn=attn)) == "flash_attention_2"
    assert FSDPEngine._attn(SimpleNamespace(device=torch.device("cpu")), EngineSpec(sp=2)) == "sdpa"
    from rlctl.errors import UserError
    from rlctl.support import JobFacts, problems

    (eager,) = problems(JobFacts(sp=2, attn="eager"), "sp_attn")  # the planner's rule, asked by the engine too
    with pytest.raises(UserError, match=f"^{re.escape(str(eager))}$"):
        FSDPEngine._attn(cuda, EngineSpec(sp=2, attn="eager"))

    calls = []
    monkeypatch.setattr(varlen, "flash_varlen", lambda: _fake_flash_varlen(calls))
    seen = {}

    def model(**kwargs):  # FAKE model: the decoder layers' attention call with the forward's kwargs
        q, k, v = (torch.randn(1, h, 8, 16) for h in (4, 2, 2))
        out, _ = ulysses.attention(
            None,
            q,
            k,
            v,
            None,
            scaling=0.25,
            **{key: kwargs[key] for key in ("rlctl_sp", "rlctl_blocks", "rlctl_flash")},
        )
        seen.update(out=out)
        return SimpleNamespace(logits=torch.zeros(1, len(kwargs["logits_to_keep"]), 5))

    dims = sp_grid(1, "cpu")
    ids = torch.arange(8)[None]
    mb = SimpleNamespace(
        input_ids=ids, position_ids=ids, blocks=None, attention_mask=None, keep_cols=None, logit_index=None
    )
    ulysses.forward_logits(model, mb, dims, flash=True)
    assert calls and calls[0]["sequences"] == 1 and seen["out"].shape == (1, 8, 4, 16)


def _sp_flash_rank(rank: int, init: str, kv_heads: int) -> None:
    """One of 2 gloo ranks: the Ulysses attention of its half of two rows (packed documents; a prompt and
    three responses sharing it), forward and backward, through the FAKE flash kernel and through sdpa."""
    import torch.distributed as dist

    from rlctl.engines import ulysses, varlen
    from rlctl.engines.dims import sp_grid

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    calls: list = []
    varlen.flash_varlen = lambda: _fake_flash_varlen(calls)  # FAKE: flash-attn needs CUDA
    dims = sp_grid(2, "cpu")
    docs, _ = _packed_blocks([5, 9, 7])
    shared, length = _packed_blocks([4, 5, 6], prefix=6)
    blocks = docs + [(1, *b[1:]) for b in shared]  # row 1: the prompt and its responses
    g = torch.Generator().manual_seed(kv_heads)
    q, k, v = (torch.randn(2, h, 22, 16, generator=g) for h in (4, kv_heads, kv_heads))  # 21 tokens, padded
    grad_out = torch.randn(2, 22, 4, 16, generator=g)
    full = [x[:, :, :length].clone().requires_grad_() for x in (q, k, v)]
    want = _by_hand(*full, blocks, 0.25)  # every block alone on one process
    (want * grad_out[:, :length]).sum().backward()
    cols = slice(rank * 11, (rank + 1) * 11)
    for flash in (True, False):
        mine = [x[:, :, cols].clone().requires_grad_() for x in (q, k, v)]
        out, _ = ulysses.attention(
            None, *mine, None, scaling=0.25, rlctl_sp=dims, rlctl_blocks=blocks, rlctl_flash=flash
        )
        (out * grad_out[:, cols]).sum().backward()
        pieces = [torch.empty_like(out) for _ in range(2)]
        dist.all_gather(pieces, out.detach())
        torch.testing.assert_close(torch.cat(pieces, 1)[:, :length], want.detach(), rtol=1e-5, atol=1e-6)
        for got, ref in zip(mine, full):
            ref_grad = torch.nn.functional.pad(ref.grad, (0, 0, 0, 22 - length))[:, :, cols]
            torch.testing.assert_close(got.grad, ref_grad, rtol=1e-4, atol=1e-5)
        assert bool(calls) == flash  # the flash call: one per forward, over both rows' blocks, 2 of the 4 heads
        assert not calls or calls[0] == {"sequences": len(blocks), "max_q": 9, "max_k": 12, "causal": True}
        calls.clear()
    dist.destroy_process_group()


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_sequence_parallel_flash_attention_equals_each_document_alone(kv_heads, tmp_path):
    """model.attn=flash_attention_2 with --sp (rlctl.support.sp_attn allows it): after the all-to-all each of
    2 ranks holds the whole sequence for half the heads, and flash-attn's varlen kernel gets the per-document
    layout of the whole micro-batch (cu_seqlens from rlctl_blocks, not the shard's position_ids): outputs
    and the q, k, v gradients of each rank's half equal every document computed alone on one process, as
    the sdpa path does. 2 KV heads (one per rank) and 1 (repeated for both). (FAKE: the kernel, flash-attn's
    documented semantics in torch; the all-to-alls are gloo's.)"""
    torch.multiprocessing.spawn(_sp_flash_rank, args=(f"file://{tmp_path / 'init'}", kv_heads), nprocs=2, join=True)


# ---------------------------------------------------------------------------------------------
# 6. SGLang: the free memory it is sized from, and the images it is sent


def test_sglang_reads_free_memory_after_releasing_the_allocators_cache(monkeypatch, tiny_model_dir):
    """SGLang's ``mem_fraction_static`` is a share of the memory free when it starts, so the adapter reads
    ``torch.cuda.mem_get_info`` to convert rlctl's fraction. It read it with the trainer's caching
    allocator still holding the blocks it freed (here 30 GiB, free to give back): 30 GiB looked free where
    60 are, and a 40 GiB engine was refused. The cache is now released first (gc, empty_cache).
    (FAKE: sglang.Engine records its arguments; torch.cuda's allocator is an 80 GiB GPU with 20 GiB in use
    and 30 GiB cached.)"""
    import rlctl.rollout.sglang as adapter
    from rlctl.rollout import make_rollout_engine
    from rlctl.rollout.spec import RolloutSpec
    from tests.rollout.test_rollout import FakeSGLangEngine

    gpu = {"used": 20 * GIB, "cached": 30 * GIB, "total": 80 * GIB}
    monkeypatch.setattr(adapter, "_import_engine_class", lambda: FakeSGLangEngine)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: gpu.update(cached=0))
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (gpu["total"] - gpu["used"] - gpu["cached"], gpu["total"])
    )
    FakeSGLangEngine.instances.clear()
    spec = RolloutSpec(
        engine="sglang",
        model_path=str(tiny_model_dir),
        device="cuda:0",
        dtype="bf16",
        mem_fraction=0.5,
        max_model_len=64,
    )
    make_rollout_engine(spec)
    (fake,) = FakeSGLangEngine.instances
    assert fake.kwargs["mem_fraction_static"] == pytest.approx(40 / 60, abs=1e-4)  # 40 GiB of the 60 free


def test_sglang_image_request_sends_each_prompts_pixels_once_in_the_engine_dtype(monkeypatch, tiny_vl_model_dir):
    """A vision-language rollout sent each prompt n times, each copy with the same fp32 pixels (SGLang
    serializes and processes every request's images: n x the pixel bytes per prompt). Each prompt is now
    sent once with SGLang's parallel sampling (``n``) and its pixels in the engine's dtype: 1/(2n) of the
    bytes. (FAKE: sglang.Engine, expanding n as SGLang's tokenizer manager does.)"""
    from transformers import AutoTokenizer

    import rlctl.rollout.sglang as adapter
    from rlctl.data.vision import load_processor
    from rlctl.rollout import make_rollout_engine
    from rlctl.rollout.base import SamplingParams
    from rlctl.rollout.spec import RolloutSpec
    from tests.rollout.test_rollout import FakeSGLangEngine
    from tests.rollout.test_sglang_vision import FakeSGLangVL
    from tests.support.vlm_rl import vl_prompt

    monkeypatch.setattr(adapter, "_import_engine_class", lambda: FakeSGLangVL)
    FakeSGLangEngine.instances.clear()
    vp = load_processor(str(tiny_vl_model_dir), AutoTokenizer.from_pretrained(tiny_vl_model_dir))
    spec = RolloutSpec(
        engine="sglang", model_path=str(tiny_vl_model_dir), device="cpu", dtype="bf16", max_model_len=256
    )
    engine = make_rollout_engine(spec)
    prompts = [vl_prompt(vp, colour, (56, 56), "Which colour?") for colour in ("red", "blue")]
    n = 4
    samples = engine.generate([p[0] for p in prompts], n, SamplingParams(max_tokens=3), images=[p[1] for p in prompts])
    assert [s.prompt_index for s in samples] == [0] * n + [1] * n
    (_, image_data), _ = FakeSGLangEngine.instances[0].calls[-2:]
    sent = [item["pixel_values"] for entry in image_data for item in entry]
    fp32_once = sum(np.asarray(p[1][0], dtype=np.float32).nbytes for p in prompts)
    assert sum(t.nbytes for t in sent) == fp32_once // 2  # was n * fp32_once
    for t, p in zip(sent, prompts):
        assert torch.equal(t, torch.as_tensor(p[1][0]).to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# 7. One GPU: FSDP2 when asked, and the dry run says which wrapper


@pytest.mark.parametrize(("shard", "wrapper"), [(True, "FSDP2 fully_shard over 1 rank"), (None, "plain module")])
def test_one_gpu_plan_exercises_fsdp2_when_asked_and_says_so(monkeypatch, capsys, tmp_path, shard, wrapper):
    """A one-GPU plan runs the plain module unless parallel.shard is set; a GPU check that must exercise
    FSDP2 (and its NCCL collectives) on one GPU sets it: the plan, the resolved config and the engine spec
    keep it, and ``--dry-run`` names the wrapper the run gets."""
    from rlctl.config import build_config, dotted_to_nested
    from rlctl.engines.spec import EngineSpec
    from rlctl.plan import apply_plan
    from rlctl.plan.inputs import LocalEnv
    from rlctl.plan.planner import plan_config
    from rlctl.presets import method_layers
    from tests.support.cli import rlctl_in_process
    from tests.support.sft import write_jsonl

    sets = {"model.name": "Qwen2.5-0.5B", "hardware.device": "cuda", "hardware.gpus": 1, "hardware.gpu": "H100"}
    if shard:
        sets["parallel.shard"] = True
    cfg = build_config("grpo", method_layers("grpo", None) + [dotted_to_nested(sets)])
    plan = plan_config(cfg, LocalEnv())
    resolved = apply_plan(cfg, plan)
    assert plan.shard is bool(shard) and resolved.parallel.shard is bool(shard)
    assert EngineSpec.from_config(resolved).shard is bool(shard)

    data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"}])
    args = ["grpo", "--model", "Qwen2.5-0.5B", "--data", str(data), "--device", "cuda", "--gpus", "1"]
    code, text = rlctl_in_process(
        monkeypatch, capsys, *args, "--gpu", "H100", *(["--shard"] if shard else []), "--dry-run"
    )
    assert code == 0, text
    (line,) = [ln for ln in text.splitlines() if "engine wrapper" in ln]
    assert wrapper in line
