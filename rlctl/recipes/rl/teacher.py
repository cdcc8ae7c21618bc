"""The teacher of on-policy distillation (``algo.teacher``, :mod:`rlctl.algos.distill`, docs/distill.md): a
frozen engine built like the reference model (the same spec, so the same placement: colocated with the
actor, sharded the same way, offloaded when the plan offloads idle weights), loaded from the teacher's
weights. It scores the student's samples and turns the step's advantages into the distillation ones."""

from __future__ import annotations

import torch

from rlctl.algos.distill import centred, distill_gap, mix_advantages
from rlctl.config import RunConfig
from rlctl.config.algorithm import teacher_vocab_problem
from rlctl.engines import EngineSpec, build_engine
from rlctl.engines.base import TrainEngine, load_tokenizer, model_source
from rlctl.errors import UserError
from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.recipes.rl.metrics import Metrics, timed
from rlctl.recipes.rl.passes import compute_logprobs
from rlctl.runtime.dist import global_sums
from rlctl.support import JobFacts, refuse


class Teacher:
    """The frozen teacher engine, the weight of its advantage (``algo.teacher_weight``) and whether the gap is
    taken against the batch's mean (``algo.teacher_baseline``)."""

    def __init__(self, engine: TrainEngine, weight: float, baseline: bool = False, full: bool = False):
        self.engine, self.weight, self.baseline, self.full = engine, weight, baseline, full

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
        return cls(engine, cfg.algo.teacher_weight, cfg.algo.teacher_baseline, cfg.algo.distill == "full")

    @property
    def in_loss(self):
        """``algo.distill=full``: (engine, weight) for the actor's loss (``update.full_distill_loss``)."""
        return (self.engine, self.weight) if self.full else None

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
