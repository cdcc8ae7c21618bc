"""The vocab-parallel token log-probs and entropy (rlctl/algos/vocab_parallel.py) on 2 real gloo ranks, each
holding a slice of the vocabulary, against the whole-vocabulary computation (logprobs_from_logits,
entropy_from_logits): values and gradients at 1e-5 in fp32. The slices' maxima differ, so a computation that
skipped the all-reduce of the max, or of the sums, is wrong: the sabotaged runs check that this test sees it."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlctl.algos import vocab_parallel as vp
from rlctl.algos.kl import entropy_from_logits
from rlctl.algos.logprobs import logprobs_from_logits
from rlctl.algos.vocab_parallel import VocabSlice
from rlctl.engines.base import VocabParallelLogits, VocabShard

T = 0.7


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 11, generator=g, dtype=torch.float64).float() * 3
    logits[:4, 6:] += 5.0  # the halves' maxima differ, one way on some rows and the other way on others
    logits[4:, :6] += 4.0
    labels = torch.tensor([0, 10, 5, 6, 3, 9, 1, 7, 8])  # labels on both ranks' columns
    w_logp, w_ent = torch.randn(9, generator=g), torch.randn(9, generator=g)
    return logits, labels, w_logp, w_ent


def _sabotaged(drop: str):
    """``torch.distributed`` with the all-reduce of the max (``drop="max"``) or of the sums (``"sum"``) skipped."""

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None):
        if (op == dist.ReduceOp.MAX) != (drop == "max"):
            dist.all_reduce(t, op=op, group=group)

    return types.SimpleNamespace(all_reduce=all_reduce, ReduceOp=dist.ReduceOp)


def _rank(rank: int, init: str, split: int, drop: str | None, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if drop:
        vp.dist = _sabotaged(drop)
    logits, labels, w_logp, w_ent = _inputs()
    cols = slice(0, split) if rank == 0 else slice(split, logits.shape[1])
    got = {}
    for what in ("both", "logp", "entropy"):  # each output's gradient alone, and both together
        mine = logits[:, cols].clone().requires_grad_(True)
        logp, ent = VocabSlice(mine, cols.start, dist.group.WORLD).logprobs(labels, T)
        loss = {"both": (w_logp * logp).sum() + (w_ent * ent).sum(), "logp": (w_logp * logp).sum()}
        loss.setdefault(what, (w_ent * ent).sum())
        loss[what].backward()
        got[what] = (logp.detach(), ent.detach(), mine.grad)
    got["full"] = None
    if split == 6:  # this rank's 6 columns of the vocabulary padded to 12 (rank 1: 5 + 1 padding)
        padded = torch.zeros(1, 9, 6)
        padded[0, :, : cols.stop - cols.start] = logits[:, cols]
        shard = VocabShard(dist.group.WORLD, cols.start, cols.stop - cols.start)
        got["full"] = VocabParallelLogits(padded, shard, 11).full()
    got["dispatch"] = logprobs_from_logits(VocabSlice(logits[:, cols], cols.start, None), labels, T, with_entropy=True)
    torch.save(got, f"{out}.{rank}")
    dist.destroy_process_group()


def _run(tmp_path, split: int, drop: str | None = None) -> list[dict]:
    out = str(tmp_path / f"r{split}{drop}")
    mp.spawn(_rank, args=(f"file://{tmp_path}/init{split}{drop}", split, drop, out), nprocs=2, join=True)
    return [torch.load(f"{out}.{r}") for r in range(2)]


def _full(what: str):
    logits, labels, w_logp, w_ent = _inputs()
    whole = logits.clone().requires_grad_(True)
    logp, ent = logprobs_from_logits(whole, labels, T), entropy_from_logits(whole / T)
    loss = {"both": (w_logp * logp).sum() + (w_ent * ent).sum(), "logp": (w_logp * logp).sum()}
    loss.setdefault(what, (w_ent * ent).sum())
    loss[what].backward()
    return logp.detach(), ent.detach(), whole.grad


def _agrees(ranks: list[dict], split: int) -> bool:
    close = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    for what in ("both", "logp", "entropy"):
        logp, ent, grad = _full(what)
        for rank, got in enumerate(ranks):
            cols = slice(0, split) if rank == 0 else slice(split, grad.shape[1])
            if not (close(got[what][0], logp) and close(got[what][1], ent) and close(got[what][2], grad[:, cols])):
                return False
    return True


@pytest.mark.parametrize("split", [6, 11])  # 6 | 5 columns; every column on rank 0 (rank 1: padding only)
def test_split_log_probs_entropy_and_gradients_equal_the_whole_vocabulary(tmp_path, split):
    ranks = _run(tmp_path, split)
    assert _agrees(ranks, split)
    if split == 6:  # VocabParallelLogits.full (the SFT logits dump's gather) cuts the padding back off
        assert all(torch.equal(got["full"][0], _inputs()[0]) for got in ranks)
    logp, ent, _ = _full("both")
    for got in ranks:  # logprobs_from_logits reads a VocabSlice the same way (its entropy without gradient)
        assert torch.allclose(got["dispatch"][0], logp, atol=1e-5) and torch.allclose(
            got["dispatch"][1], ent, atol=1e-5
        )


@pytest.mark.parametrize("drop", ["max", "sum"])
def test_a_skipped_all_reduce_is_caught(tmp_path, drop):
    assert not _agrees(_run(tmp_path, 6, drop), 6)
