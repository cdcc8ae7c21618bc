"""The teacher of on-policy distillation (``algo.teacher``, :mod:`rlctl.algos.distill`, docs/distill.md): a
frozen engine built like the reference model (the same spec, so the same placement: colocated with the
actor, sharded the same way, offloaded when the plan offloads idle weights), loaded from the teacher's
weights. It scores the student's samples and turns the step's advantages into the distillation ones. With
``--teacher-data`` (GKD's mixture) some steps train on the teacher's own responses instead (:class:`TeacherData`)."""

from __future__ import annotations

import random

import torch

from rlctl.algos.distill import centred, distill_gap, mix_advantages, teacher_data_index
from rlctl.config import RunConfig
from rlctl.config.algorithm import teacher_vocab_problem
from rlctl.data.packing import MicroBatch
from rlctl.data.responses import ResponseRow, read_responses
from rlctl.engines import EngineSpec, build_engine
from rlctl.engines.base import TrainEngine, VocabParallelLogits, VocabShard, load_tokenizer, model_source
from rlctl.errors import UserError
from rlctl.recipes.rl.batch import RolloutBatch, rank_positions
from rlctl.recipes.rl.metrics import Metrics, timed
from rlctl.recipes.rl.passes import compute_logprobs
from rlctl.runtime.dist import global_sums
from rlctl.support import JobFacts, refuse


class Teacher:
    """The frozen teacher engine, the weight of its advantage (``algo.teacher_weight``) and whether the gap is
    taken against the batch's mean (``algo.teacher_baseline``)."""

    def __init__(
        self,
        engine: TrainEngine,
        weight: float,
        baseline: bool = False,
        full: bool = False,
        beta: float = 1.0,
        data: TeacherData | None = None,
    ):
        self.engine, self.weight, self.baseline, self.full = engine, weight, baseline, full
        self.beta, self.data = beta, data  # algo.distill_beta; --teacher-data's rows and steps
        # algo.distill=full with the teacher in pipeline stages: its logits computed before each update pass
        self.staged = StagedTeacher(engine) if full and engine.spec.pp > 1 else None

    @classmethod
    def for_run(cls, cfg: RunConfig, spec: EngineSpec, student_tokenizer) -> Teacher | None:
        """The run's teacher (None without ``algo.teacher``): the reference model's spec with the teacher's weights."""
        name = cfg.algo.teacher
        if not name:
            return None
        source = model_source(name)
        problem = teacher_vocab_problem(
            student_tokenizer.get_vocab(), load_tokenizer(source).get_vocab(), cfg.model.name, name
        )
        if problem:  # the same check as before launch, for a teacher only on the hub
            raise UserError(problem)
        # where the plan chose them
        facts = JobFacts(distill=cfg.algo.distill, sp=spec.sp, backend=spec.backend, pp=spec.pp, cp=spec.cp)
        refuse(facts, "distill_full_engine")
        engine = build_engine(spec.replace(model=name, random_init=False), role="ref", trainable=False, source=source)
        if cfg.algo.distill == "full":  # split over the vocabulary (Megatron's TP): at the student's columns
            rows = getattr(model_source(cfg.model.name).load_config(), "vocab_size", None)
            if rows:
                engine.vocab_shard(rows)  # (a UserError where they differ)
        a = cfg.algo
        data = TeacherData.for_run(cfg, student_tokenizer) if a.teacher_data else None
        return cls(engine, a.teacher_weight, a.teacher_baseline, a.distill == "full", a.distill_beta, data)

    @property
    def in_loss(self):
        """``algo.distill=full``: (engine, weight, beta) for the actor's loss (``update.full_distill_loss``); the
        engine is a :class:`StagedTeacher` where the teacher runs in pipeline stages."""
        return (self.staged or self.engine, self.weight, self.beta) if self.full else None

    def apply(self, batch: RolloutBatch, temperature: float, budget: int, pad_id: int, group) -> Metrics:
        """The teacher's log-probs of the sampled tokens; ``batch.advantages`` (the task reward's) becomes the
        weighted mix with the gap to the student's log-probs (``batch.old_logp``, taken before the update)."""
        if self.full:  # the teacher is read in the update; the task's advantage keeps its share
            zero = torch.zeros_like(batch.mask)
            batch.advantages = mix_advantages(batch.advantages, zero, batch.mask, self.weight)
            return {}
        m: Metrics = {}
        with timed(m, "time/teacher"):
            teacher_logp, _ = compute_logprobs(
                self.engine, batch, temperature=temperature, budget=budget, pad_id=pad_id
            )
        gap = distill_gap(teacher_logp, batch.old_logp, batch.mask)
        s = global_sums({"gap": gap.sum(), "tok": batch.mask.sum()}, batch.mask.device, group)
        mean = s["gap"] / max(1.0, s["tok"])
        m["distill/reverse_kl"] = -mean  # mean log p_student - log p_teacher per token
        signal = centred(gap, batch.mask, mean) if self.baseline else gap
        batch.advantages = mix_advantages(batch.advantages, signal, batch.mask, self.weight)
        return m


class StagedTeacher:
    """``algo.distill=full`` with a teacher split into Megatron pipeline stages (``parallel.pp`` above 1): the
    student's loss runs on the last stage only, inside the student's pipeline schedule, where the teacher's own
    pipeline cannot run. So :meth:`fill` runs the teacher's forward-only pipeline over the micro-batches of an update
    pass first (the same objects the student's pass then gets) and keeps, on the last stage only, each one's logits
    at its response positions (this TP rank's vocabulary columns at tp > 1), keyed by the micro-batch; the loss then
    reads them through :meth:`forward_micro` / :meth:`forward_vocab_shard`, which return them as an engine that
    computed only the response positions does (``[1, N, V]``, read by ``mb.at_response``). Memory: the teacher's
    logits at the response positions of every micro-batch of the pass, until the loss of each has read its own."""

    def __init__(self, engine: TrainEngine):
        self.engine = engine
        self.held: dict[int, torch.Tensor] = {}  # id(micro-batch) -> its teacher logits [N, V] (last stage)

    def vocab_shard(self, vocab_size: int) -> VocabShard | None:
        return self.engine.vocab_shard(vocab_size)

    def fill(self, micro: list[MicroBatch]) -> None:
        """The teacher's forward-only pipeline over ``micro`` (collective over the pipeline; no gradient)."""

        def keep(output, mb: MicroBatch):
            if not mb.dummy:  # (the last stage: the logits, or at tp > 1 this rank's columns, never gathered)
                local = output.local if isinstance(output, VocabParallelLogits) else output
                self.held[id(mb)] = mb.at_response(local).detach()
            return None, {}

        self.held.clear()
        self.engine.forward_backward(micro, keep, forward_only=True)

    def forward_micro(self, mb: MicroBatch) -> torch.Tensor | None:
        """The logits :meth:`fill` kept for ``mb`` (once each: then dropped), ``[1, N, V]``; None for a dummy
        (its pass ran in :meth:`fill`)."""
        if mb.dummy:
            return None
        if id(mb) not in self.held:
            raise RuntimeError("the teacher's logits of this micro-batch were not computed before the update pass")
        return self.held.pop(id(mb))[None]

    forward_vocab_shard = forward_micro


class TeacherData:
    """``--teacher-data``: the teacher's own responses (:mod:`rlctl.data.responses`) and the steps that train on
    them (:func:`~rlctl.algos.distill.teacher_data_index`). Such a step reads the next ``batch_size x n`` rows of
    the file in an order shuffled per pass with ``train.seed`` (the same on every rank), so which rows a step
    reads is a function of the step: a resumed run reads the same."""

    def __init__(self, rows: list[ResponseRow], fraction: float, warmup: int, seed: int):
        self.rows, self.fraction, self.warmup, self.seed = rows, fraction, warmup, seed
        self._order: tuple[int, list[int]] = (-1, [])  # (pass, its order): a step's rows lie in one or two passes

    @classmethod
    def for_run(cls, cfg: RunConfig, tokenizer) -> TeacherData:
        a = cfg.algo
        rows, _ = read_responses(a.teacher_data, tokenizer, cfg)
        return cls(rows, a.teacher_data_fraction, a.teacher_data_warmup, cfg.train.seed)

    def index(self, step: int) -> int | None:
        """Step ``step``'s index among the steps on the teacher's rows, or None (the student samples)."""
        return teacher_data_index(step, self.fraction, self.warmup)

    def row(self, g: int) -> ResponseRow:
        """The ``g``-th row of the shuffled stream of rows (a new order each pass over the file)."""
        passes, at = divmod(g, len(self.rows))
        if self._order[0] != passes:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + passes).shuffle(order)
            self._order = (passes, order)
        return self.rows[self._order[1][at]]

    def batch(self, k: int, *, n: int, batch_size: int, mini: int, rank: int, world: int, width: int, device):
        """This rank's rows of the ``k``-th step on the teacher's rows, as a batch of ``batch_size`` groups of
        ``n`` (each rank takes the groups of its prompt positions, as a sampled step's). The rows are nobody's
        sample: their ``rollout_logp`` is 0 until the step sets it to the actor's own (weights of 1)."""
        positions = rank_positions(batch_size, mini, rank, world)
        picked = [(p * n + j, self.row(k * batch_size * n + p * n + j)) for p in positions for j in range(n)]
        return RolloutBatch.build(
            [r.prompt for _, r in picked],
            [r.response for _, r in picked],
            [[0.0] * len(r.response) for _, r in picked],
            [uid for uid, _ in picked],
            n=n,
            batch_size=batch_size,
            mini_batch_size=mini,
            width=width,
            truncated=[r.truncated for _, r in picked],
            device=device,
            loss_masks=[r.mask for _, r in picked],
        )
