"""``vocab_parallel_jsd`` (rlctl/algos/vocab_parallel.py) on 2 real gloo ranks, each holding a slice of both models'
vocabulary, against an independent single-process computation of TRL's generalized JSD (``GKDTrainer.
generalized_jsd_loss``'s formula, written here with plain torch autograd in float64) on the whole logits: values
and the student's gradients at 1e-5, at beta 0 (forward KL), 0.3, 0.5 (mixtures) and 1 (reverse KL), temperatures
1 and 0.7, split 6 | 5 columns and 11 | 0 (rank 1 all padding). On some rows the student's two slices have very
different maxima one way, on others the other way, and the teacher's the opposite way.

The chunked path (``CHUNK_ELEMENTS`` 13: 2-row chunks of 6 columns, the last one ragged; 1-row chunks of 11) equals
the unchunked one, for the JSD and for the vocab-parallel log-probs and entropies.

A dropped all-reduce is caught: runs with the n-th all-reduce of the forward skipped (0: the maxima, 1: the sums
of exponentials, 2: the JSD's and the gradient's sums) disagree with the whole-vocabulary values
(``test_each_all_reduce_is_needed``; the value comparison of :func:`_agrees` catches each).

One ``mp.spawn`` computes every case (the module's fixture), so the module runs in a few seconds."""

from __future__ import annotations

import itertools
import math
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlctl.algos import vocab_parallel as vp
from rlctl.algos.vocab_parallel import VocabSlice, vocab_parallel_jsd, vocab_parallel_reverse_kl

BETAS = (0.0, 0.3, 0.5, 1.0)
TEMPERATURES = (1.0, 0.7)
SPLITS = (6, 11)  # 6 | 5 columns; every column on rank 0 (rank 1: padding only)
SMALL_CHUNK = 13
DROPS = (0, 1, 2)
DTYPES = (torch.float64, torch.float32)


def _inputs(dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student and teacher logits [9, 11] (float32 values, in ``dtype``), the loss's upstream weights [9], labels."""
    g = torch.Generator().manual_seed(0)
    student = torch.randn(9, 11, generator=g, dtype=torch.float64).float() * 3
    teacher = torch.randn(9, 11, generator=g, dtype=torch.float64).float() * 2
    student[:4, 6:] += 6.0  # the student's slices' maxima differ one way on some rows, the other way on others
    student[4:, :6] += 5.0
    teacher[:4, :6] += 4.0  # and the teacher's the opposite way
    teacher[4:, 6:] += 7.0
    weights = torch.randn(9, generator=g, dtype=torch.float64).float()
    labels = torch.tensor([0, 10, 5, 6, 3, 9, 1, 7, 8])
    return student.to(dtype), teacher.to(dtype), weights.to(dtype), labels


def reference_jsd(student: torch.Tensor, teacher: torch.Tensor, temperature: float, beta: float) -> torch.Tensor:
    """TRL 1.16 ``GKDTrainer.generalized_jsd_loss`` per token (summed over the vocabulary, before masking): beta 0
    ``KL(p_t || p_s)``, beta 1 ``KL(p_s || p_t)``, else ``beta KL(p_t || m) + (1 - beta) KL(p_s || m)`` with
    ``log m = logsumexp(log p_s + log(1 - beta), log p_t + log beta)``."""
    log_s = torch.log_softmax(student / temperature, -1)
    log_t = torch.log_softmax(teacher.detach() / temperature, -1)
    kl = lambda p, q: (p.exp() * (p - q)).sum(-1)  # noqa: E731  KL(exp p || exp q) from log-probs
    if beta == 0:
        return kl(log_t, log_s)
    if beta == 1:
        return kl(log_s, log_t)
    log_m = torch.logsumexp(torch.stack([log_s + math.log(1 - beta), log_t + math.log(beta)]), 0)
    return beta * kl(log_t, log_m) + (1 - beta) * kl(log_s, log_m)


def _dropping(n: int):
    """``torch.distributed`` whose ``n``-th all-reduce (counted from this object's creation) is skipped."""
    calls = itertools.count()

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        if next(calls) != n:
            dist.all_reduce(t, op=op, group=group)

    return types.SimpleNamespace(all_reduce=all_reduce, ReduceOp=dist.ReduceOp)


def _jsd(student, teacher, weights, cols, temperature, beta):
    """This rank's (JSD [9], the student slice's gradient of ``sum(weights * jsd)``, the teacher's gradient)."""
    mine, theirs = student[:, cols].clone().requires_grad_(True), teacher[:, cols].clone().requires_grad_(True)
    jsd = vocab_parallel_jsd(mine, theirs, temperature, beta, dist.group.WORLD)
    (weights * jsd).sum().backward()
    return jsd.detach(), mine.grad, theirs.grad


def _logprobs(student, labels, weights, cols, temperature):
    mine = student[:, cols].clone().requires_grad_(True)
    logp, ent = VocabSlice(mine, cols.start, dist.group.WORLD).logprobs(labels, temperature)
    (weights * logp + weights.flip(0) * ent).sum().backward()
    return logp.detach(), ent.detach(), mine.grad


def _rank(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    got = {}
    for dtype, split, temperature in itertools.product(DTYPES, SPLITS, TEMPERATURES):
        student, teacher, weights, labels = _inputs(dtype)
        cols = slice(0, split) if rank == 0 else slice(split, student.shape[1])
        for chunk, elements in (("whole", vp.CHUNK_ELEMENTS), ("small", SMALL_CHUNK)):
            default, vp.CHUNK_ELEMENTS = vp.CHUNK_ELEMENTS, elements
            for beta in BETAS:
                key = "jsd", dtype, split, temperature, beta, chunk
                got[key] = _jsd(student, teacher, weights, cols, temperature, beta)
            got["logp", dtype, split, temperature, chunk] = _logprobs(student, labels, weights, cols, temperature)
            vp.CHUNK_ELEMENTS = default
    student, teacher, weights, _ = _inputs()
    cols = slice(0, 6) if rank == 0 else slice(6, 11)
    for n, beta in itertools.product(DROPS, BETAS):
        vp.dist = _dropping(n)
        got["drop", n, beta] = _jsd(student, teacher, weights, cols, 0.7, beta)
    vp.dist = dist
    mine = student[:, cols].clone().requires_grad_(True)
    kl = vocab_parallel_reverse_kl(mine, teacher[:, cols], 0.7, dist.group.WORLD)
    (weights * kl).sum().backward()
    got["reverse_kl"] = kl.detach(), mine.grad, None
    torch.save(got, f"{out}.{rank}")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("jsd")
    mp.spawn(_rank, args=(f"file://{tmp}/init", str(tmp / "out")), nprocs=2, join=True)
    return [torch.load(tmp / f"out.{r}") for r in range(2)]


def _whole(temperature: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference JSD [9] and the student's gradient [9, 11] of ``sum(weights * jsd)``, in float64."""
    student, teacher, weights, _ = _inputs()
    s = student.requires_grad_(True)
    jsd = reference_jsd(s, teacher, temperature, beta)
    (weights * jsd).sum().backward()
    return jsd.detach(), s.grad


def _agrees(got: tuple, split: int, rank: int, temperature: float, beta: float, atol: float = 1e-5) -> bool:
    """This rank's JSD and student gradient equal the reference's (its columns'), and the teacher got none."""
    jsd, grad = _whole(temperature, beta)
    cols = slice(0, split) if rank == 0 else slice(split, 11)
    close = lambda a, b: a.dtype == got[0].dtype and torch.allclose(a.double(), b, rtol=1e-5, atol=atol)  # noqa: E731
    return close(got[0], jsd) and close(got[1], grad[:, cols]) and got[2] is None


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("beta", BETAS)
def test_split_jsd_and_student_gradient_equal_the_whole_vocabulary(ranks, split, temperature, beta):
    """float64 logits at 1e-5; float32 logits (float32 math, the reverse KL's gradient ``p_s (gap - KL) / T`` of
    log-ratios near 30 loses ~1e-5 to rounding) at 5e-5."""
    for rank, got in enumerate(ranks):
        assert _agrees(got["jsd", torch.float64, split, temperature, beta, "whole"], split, rank, temperature, beta)
        f32 = got["jsd", torch.float32, split, temperature, beta, "whole"]
        assert _agrees(f32, split, rank, temperature, beta, atol=5e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_chunked_equals_unchunked(ranks, dtype, split, temperature):
    same = lambda a, b: all(x is y or torch.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b))  # noqa: E731
    for got in ranks:
        for beta in BETAS:
            chunked, whole = (got["jsd", dtype, split, temperature, beta, c] for c in ("small", "whole"))
            assert same(chunked, whole)
        assert same(got["logp", dtype, split, temperature, "small"], got["logp", dtype, split, temperature, "whole"])


def test_each_all_reduce_is_needed(ranks):
    for n, beta in itertools.product(DROPS, BETAS):
        assert not all(_agrees(got["drop", n, beta], 6, rank, 0.7, beta) for rank, got in enumerate(ranks)), (n, beta)


def test_reverse_kl_is_beta_one(ranks):
    for got in ranks:
        jsd = got["jsd", torch.float64, 6, 0.7, 1.0, "whole"]
        assert all(torch.equal(a, b) for a, b in zip(got["reverse_kl"][:2], jsd))


def test_reference_is_trls_generalized_jsd():
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    student, teacher, _, _ = _inputs(torch.float32)
    for temperature, beta in itertools.product(TEMPERATURES, BETAS):
        trl = gkd.GKDTrainer.generalized_jsd_loss(
            student[None], teacher[None], beta=beta, temperature=temperature, reduction="none"
        ).sum(-1)[0]
        assert torch.allclose(reference_jsd(student, teacher, temperature, beta), trl, atol=1e-5), (temperature, beta)


@pytest.mark.parametrize("beta", BETAS)
def test_the_backward_saves_no_float32_copy_of_the_slice(process_group, beta):
    """What the estimator counts (rlctl.estimate.training.logits_bytes on Megatron's TP: no fp32 bytes per logit):
    the JSD and the log-probs save the bf16 logits and ``[N]`` statistics, nothing of ``[N, V]`` in float32
    (before the chunking the reverse KL saved the student's fp32 softmax and log-ratio), counted with
    saved-tensor hooks."""
    n, v = 16, 300
    student, teacher = torch.randn(n, v).bfloat16().requires_grad_(True), torch.randn(n, v).bfloat16()
    saved = []

    def pack(x):
        saved.append((x.dtype, x.numel()))
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        jsd = vocab_parallel_jsd(student, teacher, 0.7, beta, dist.group.WORLD)
        logp, ent = VocabSlice(student, 0, dist.group.WORLD).logprobs(torch.arange(n), 0.7)
    assert not [s for s in saved if s[1] >= n * v and s[0] != torch.bfloat16], saved
    assert sum(s[1] >= n * v for s in saved) == 3  # the student's and the teacher's logits, the student's again
    (jsd.sum() + logp.sum() + ent.sum()).backward()
    assert student.grad.dtype == torch.bfloat16 and student.grad.isfinite().all()
