"""``algo.distill=full`` on 2 ranks that split one model: the worker of tests/recipes/test_distill.py.

Usage: torchrun --nproc-per-node 2 distill_full_parallel.py {sp|tp|pp} STUDENT_DIR TEACHER_DIR OUT_PT [BETA]

(BETA: ``algo.distill_beta``, default 1, the reverse KL; the saved ``kl_sum`` is then that divergence's sum.)

* ``sp``: the FSDP engine with Ulysses sp 2 (one data-parallel replica): the student's and the teacher's logits
  are each rank's sequence shard;
* ``tp``: the Megatron engine at tp 2 (megatron-core on CPU through megatron_cpu_patches): the teacher's logits
  are each rank's vocabulary columns, never gathered.
* ``pp``: the Megatron engine at pp 2 (one layer per stage) on the test's ``three_rows``, three micro-batches of
  the same shape: the teacher's pipeline runs first (``StagedTeacher.fill``, as ``ppo_update`` calls it) and the
  last stage's loss reads each micro-batch's kept logits. Only the first pass; the last stage (rank 1) saves.
* ``tppp``: the same at tp 2 x pp 2 on 4 processes (each last-stage rank keeps its vocabulary columns); rank 2
  (the last stage's tp rank 0) saves.

Both ranks run the actor update's loss (``policy_loss_fn`` with the teacher in it) on the test's tool batch, one
``forward_backward``; rank 0 saves the summed reverse KL, the token count and the full gradients under HF names.
Then, on fresh gradients, a second ``forward_backward`` whose loss is the sampled tokens' log-probs and entropies
read as the recipe reads them (:func:`logp_entropy_pass`; on Megatron vocab-parallel, the vocabulary never
gathered): rank 0 saves them and that loss's full gradients too.
``tp`` also saves ``vocab_parallel_reverse_kl`` of random logits split over the two ranks (each rank's slice
shifted by another constant, so the two slices' maxima differ) with its gradient, and ``full_reverse_kl`` of the
whole tensor with its gradient, computed here on one rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
if sys.argv[1] in ("tp", "pp", "tppp"):
    import megatron_cpu_patches  # noqa: F401  (before megatron.core)

import torch
import torch.distributed as dist

from rlctl.algos.distill import divergence_metric
from rlctl.config import build_config, dotted_to_nested
from rlctl.recipes.rl.batch import micro_batches
from rlctl.recipes.rl.spec import AlgoSpec
from rlctl.recipes.rl.teacher import Teacher
from rlctl.recipes.rl.update import policy_loss_fn
from tests.recipes.test_distill import TEMPERATURE, W_ENTROPY, W_LOGP, three_rows, tool_batch
from tests.support.sft import cpu_spec


def megatron_grads(engine) -> dict[str, torch.Tensor]:
    """The engine's gradients (DDP's main_grad) gathered over TP, under HF names (collective)."""
    from rlctl.engines.megatron.parallel import layer_stages
    from rlctl.engines.megatron.weights import StageGather, in_stage, layout_state
    from rlctl.formats.megatron_layout import megatron_to_hf

    grads = {n: p.main_grad for n, p in layout_state(engine.gpt).items()}
    gather = StageGather(grads, engine.tp, engine.pp, engine.device, torch.float32)
    where = layer_stages(engine.layout.num_layers, engine.pp)

    def get(tp_rank: int, layer: int, name: str) -> torch.Tensor:
        stage, local = where[layer]
        return gather(tp_rank, stage, in_stage(name, local))

    return {n: t.clone() for n, t in megatron_to_hf(get, engine.layout, engine.tp, engine.layout.num_layers)}


def random_split_kl(group) -> dict:
    """``vocab_parallel_reverse_kl`` on this rank's half of random [5, 12] logits and its gradient, against
    ``full_reverse_kl`` of the whole tensor."""
    from rlctl.algos.distill import full_reverse_kl, vocab_parallel_reverse_kl

    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 12, generator=g) * 2, torch.randn(5, 12, generator=g) * 2
    student[:, 6:] += 4.0  # the slices' maxima differ: a rank that skipped the max's all-reduce would be wrong
    teacher[:, :6] += 3.0
    cols = slice(6 * dist.get_rank(), 6 * dist.get_rank() + 6)
    mine = student[:, cols].clone().requires_grad_(True)
    split = vocab_parallel_reverse_kl(mine, teacher[:, cols], 0.7, group)
    (split * torch.arange(1.0, 6.0)).sum().backward()
    whole = student.clone().requires_grad_(True)
    full = full_reverse_kl(whole, teacher, 0.7)
    (full * torch.arange(1.0, 6.0)).sum().backward()
    return {"split": split.detach(), "full": full.detach(), "grad": mine.grad, "want_grad": whole.grad[:, cols]}


def logp_entropy_pass(actor, micro, mask: torch.Tensor, tokens: float, seen: list) -> dict:
    """A second forward_backward on fresh gradients: the sampled tokens' log-probs and entropies (at
    ``TEMPERATURE``, through ``response_tokens`` as the recipe reads them: vocab-parallel on Megatron) in a loss,
    and its full gradients."""
    from rlctl.algos import entropy_from_logits, logprobs_from_logits
    from rlctl.algos.vocab_parallel import VocabSlice
    from rlctl.engines.base import response_tokens

    def terms(sel, labels):
        if isinstance(sel, VocabSlice):
            return sel.logprobs(labels, TEMPERATURE)
        return logprobs_from_logits(sel, labels, TEMPERATURE), entropy_from_logits(sel.float() / TEMPERATURE)

    def loss_fn(output, mb):
        seen.append(type(output).__name__)
        logp, ent = (mb.to_matrix(x) for x in response_tokens(output, mb, terms))
        m = mb.take(mask)
        loss = ((W_LOGP * logp + W_ENTROPY * ent) * m).sum() / tokens
        return loss, {"logp": logp.detach() * m, "entropy": ent.detach() * m, "rows": mb.rows}

    (result,) = actor.forward_backward(micro, loss_fn)
    return result


def staged_update(staged, actor, micro, loss_fn) -> tuple[dict, dict, dict]:
    """pp: the teacher's pipeline first (as ``ppo_update`` runs it), then the student's pass over the same
    micro-batches: the metrics summed over the micro-batches, the full gradients, and what the test checks besides."""
    staged.fill(micro)
    results = actor.forward_backward(micro, loss_fn)
    extra = {"pp": actor.pp, "micro": len(micro), "left": len(staged.held)}  # left: 0 when each was read once
    return {k: sum(r[k] for r in results) for k in results[0]}, megatron_grads(actor), extra


def main(mode: str, student: str, teacher_dir: str, out: str, beta: str = "1.0") -> None:
    from transformers import AutoTokenizer

    from rlctl.engines import build_engine
    from rlctl.runtime.dist import init_distributed

    init_distributed("cpu")
    settings = {"model.name": student, "model.attn": "sdpa", "model.dtype": "fp32", "algo.teacher": teacher_dir}
    settings |= {"algo.distill": "full", "rollout.temperature": 0.7, "algo.distill_beta": float(beta)}
    cfg = build_config("grpo", [dotted_to_nested(settings)])
    sizes = {"tp": 2, "pp": 2} if mode == "tppp" else {mode: 2}
    layout = {"sp": 2} if mode == "sp" else {"backend": "megatron", **sizes, "max_seq_len": 64}
    spec = cpu_spec(cfg, **layout)
    teacher = Teacher.for_run(cfg, spec, AutoTokenizer.from_pretrained(student))
    actor = build_engine(spec, role="actor", trainable=True, total_steps=1)
    staged = mode in ("pp", "tppp")
    _, _, _, b = three_rows() if staged else tool_batch()
    algo = AlgoSpec.from_config(cfg)
    b.old_logp, b.rollout_logp, b.advantages = (torch.zeros_like(b.mask) for _ in range(3))
    tokens = float(b.mask.sum())
    denoms = {"global_tokens": tokens, "global_seqs": float(len(b)), "norm_len": algo.norm_len}
    loss_fn = policy_loss_fn(b, algo, denoms, 0.0, teacher.in_loss)
    seen = []

    def watched(output, mb):
        seen.append(type(output).__name__)
        return loss_fn(output, mb)

    micro = micro_batches(b, list(range(len(b))), budget=9 if staged else 64, pad_id=0, device=b.mask.device)
    if staged:
        result, grads, extra = staged_update(teacher.staged, actor, micro, watched)
    else:
        (result,) = actor.forward_backward(micro, watched)
    if mode == "sp":
        grads = {n.replace("_orig_mod.", ""): p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()}
        extra = {"sp": actor.dims.sp}
        for p in actor.model.parameters():
            p.grad = None
        extra["logp_pass"] = logp_entropy_pass(actor, micro, b.mask, tokens, seen)
        extra["logp_grads"] = {
            n.replace("_orig_mod.", ""): p.grad.full_tensor().clone() for n, p in actor.model.named_parameters()
        }
    elif mode == "tp":
        grads = megatron_grads(actor)
        actor.model.zero_grad_buffer()
        extra = {
            "logp_pass": logp_entropy_pass(actor, micro, b.mask, tokens, seen),
            "logp_grads": megatron_grads(actor),
        }
        extra |= {"tp": actor.tp, "random": random_split_kl(actor.vocab_shard(actor.layout.vocab_size).group)}
        shard = teacher.engine.vocab_shard(actor.layout.vocab_size)
        extra["shard"] = (shard.start, shard.width)  # rank 0's columns
    if dist.get_rank() == {"pp": 1, "tppp": 2}.get(mode, 0):  # pp: the last stage (tp rank 0), where the loss ran
        torch.save(
            {"kl_sum": result[divergence_metric(float(beta))], "tokens": tokens, "grads": grads, "seen": seen, **extra},
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
