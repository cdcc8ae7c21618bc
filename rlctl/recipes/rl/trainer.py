"""One GRPO / PPO run on a rank: its engines (actor, reference, critic, rollout), its data, and the
steps the recipes call in order. :func:`rlctl.runtime.fit.fit` runs the loop around them (resume,
metrics, evaluation, checkpoints, stop requests, export, summary.json)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from rlctl.algos import AdaptiveKLController, FixedKLController, get_adv_estimator, kl_estimate
from rlctl.config.algorithm import check_algorithm
from rlctl.engines import EngineSpec, build_engine
from rlctl.engines.base import TrainEngine, write_model_meta
from rlctl.errors import UserError
from rlctl.recipes.rl.advantages import compute_advantages, token_rewards
from rlctl.recipes.rl.batch import RolloutBatch, mask_truncated, token_budget
from rlctl.recipes.rl.inputs import RLInputs
from rlctl.recipes.rl.metrics import Metrics, merged, timed
from rlctl.recipes.rl.offpolicy import TrainerFeed
from rlctl.recipes.rl.passes import compute_logprobs, compute_values
from rlctl.recipes.rl.rollouts import ActorWeights, ColocatedRollout, make_engine
from rlctl.recipes.rl.sampling import Sampling
from rlctl.recipes.rl.scoring import RewardScorer
from rlctl.recipes.rl.spec import AlgoSpec
from rlctl.recipes.rl.streaming import StreamFeed
from rlctl.recipes.rl.teacher import Teacher
from rlctl.recipes.rl.turns import make_turns
from rlctl.recipes.rl.update import single_step, update_actor, update_critic
from rlctl.runtime.dist import all_gather_objects, barrier, global_sums
from rlctl.runtime.entry import RunContext

LOGPROB_DIFF_WARN = 0.1  # mean |rollout - trainer| log-prob above this: the engines disagree
# step 0: mean |rollout - trainer| log-prob beyond what the dtype explains refuses to start
LOGPROB_DIFF_REFUSE = {"fp32": 0.05, "bf16": 0.5}


def logprob_check_problem(diff: float, dtype: str) -> str | None:
    """The one line that refuses to start when the rollout engine's log-probs differ from the trainer's on
    the same tokens (mean abs ``diff`` per token, before the first update) far beyond ``dtype``'s noise."""
    bound = LOGPROB_DIFF_REFUSE.get(dtype, LOGPROB_DIFF_REFUSE["bf16"])
    if diff <= bound:
        return None
    return (
        f"before the first update the rollout engine's log-probs differ from the trainer's by {diff:.3g} per "
        f"token (at most {bound} is expected in {dtype}): the rollout weights are not the trainer's or the "
        f"prompts are templated differently; --ignore-logprob-check to train anyway"
    )


#: A recipe's step: ``(trainer, step) -> (the step's batch, its metrics)`` (rlctl.recipes.grpo / ppo).
RecipeStep = Callable[["RLTrainer", int], tuple[RolloutBatch, Metrics]]


class RLTrainer:
    """Everything one GRPO / PPO run holds, and the steps the recipes call in order; each step returns
    its metrics. Its parts: the engines (actor, reference, critic), the reward scorer and
    :class:`~rlctl.recipes.rl.sampling.Sampling` (the step's samples and validation, from the run's sample
    source: this rank's own rollout engine, or the rollout processes of a split run)."""

    def __init__(self, ctx: RunContext, inputs: RLInputs, recipe_step: RecipeStep, *, with_critic: bool):
        cfg, d = ctx.cfg, ctx.dist
        self.ctx, self.cfg, self.dist = ctx, cfg, d
        self.recipe_step = recipe_step  # the step (rlctl.recipes.rl.main.rl_step)
        # an unknown name: a one-line error naming the registered ones; needs_greedy: remax's greedy baseline
        self.needs_greedy = get_adv_estimator(cfg.algo.adv).needs_greedy
        # the same check as before launch (rlctl.checks), for a run directory written by other means
        check_algorithm(cfg)
        self.algo = a = AlgoSpec.from_config(cfg)  # the typed algorithm every step reads

        # built once per process (rl.inputs), as a split run's rollout processes build theirs
        self.source, self.tokenizer, self.data = inputs.source, inputs.tokenizer, inputs.data
        self.agent_spec, self.vision, self.rollout_spec = inputs.agent_spec, inputs.vision, inputs.rollout
        self.pad_id = self.tokenizer.pad_token_id
        ctx.log(f"data: {self.data.report.summary()}; {len(self.data.train)} train / {len(self.data.val)} val prompts")
        self.scorer = RewardScorer.for_run(cfg, self.data, self.tokenizer, d.device, ctx.log)
        self.stream = inputs.stream  # the step sampler and the data position
        self.total_steps = self.stream.total_steps
        optimizer_steps = self.stream.optimizer_steps(a.ppo_epochs)
        self.budget = token_budget(cfg)
        ctx.log(f"policy loss: {a.policy.as_metrics()}")
        self._build_engines(optimizer_steps, with_critic)
        self.kl_ctl = AdaptiveKLController(a.kl_coef, a.kl_target) if a.kl_target else FixedKLController(a.kl_coef)
        self.weights = ActorWeights(self.actor, "fp32" if self.actor.compute_dtype == torch.float32 else "bf16")
        self.sampling = self._build_sampling()
        self.logprobs_checked = cfg.rollout.ignore_logprob_check  # the step-0 check (logprob_check_problem)

    def _build_engines(self, optimizer_steps: int, with_critic: bool) -> None:
        """The actor, the reference (when a KL term reads it) and the critic (PPO); the model's meta file."""
        cfg, a, ctx = self.cfg, self.algo, self.ctx
        spec = EngineSpec.from_config(cfg)
        self.actor = build_engine(spec, role="actor", total_steps=optimizer_steps, source=self.source)
        self.ref = build_engine(spec, role="ref", trainable=False, source=self.source) if a.kl_coef > 0 else None
        # on-policy distillation (algo.teacher): a frozen teacher placed like the reference (rl.teacher)
        self.teacher = Teacher.for_run(cfg, spec, self.tokenizer)
        critic_spec = spec.replace(optimizer=spec.optimizer.replace(lr=a.critic_lr))
        self.critic = (
            build_engine(critic_spec, role="critic", total_steps=optimizer_steps, source=self.source)
            if with_critic
            else None
        )
        self.device = self.actor.device
        self.dp_group = self.actor.dp_group  # sums over the (pooled) data: over the data-parallel replicas
        if self.dist.is_main:
            write_model_meta(
                ctx.paths.model_meta, self.actor.hf_config, self.tokenizer, self.source, vision=self.vision
            )
        barrier()

    def _build_sampling(self) -> Sampling:
        """Where the samples come from: this rank's rollout engine, or in a split run (rollout.procs,
        rlctl.recipes.rl.offpolicy) the rollout processes, this process's own engine being made for the
        first evaluation only."""
        cfg, d, ctx = self.cfg, self.dist, self.ctx
        split = d.split is not None
        spec = self.rollout_spec
        tp = spec.tp
        if self.source.random_init:  # no weights on disk: the rollout engines start from the actor's (collective)
            self.actor.export_hf(spec.model_path, ctx.paths.model_meta)

        def make():
            dtype, device = self.weights.dtype, self.device
            return make_engine(cfg, d, spec, device=device, dtype=dtype, evaluation_only=split, log=ctx.log)

        engine = None if split else make()
        turns = make_turns(cfg, self.agent_spec, self.tokenizer, engine, tp)  # single- or multi-turn, chosen once
        own = ColocatedRollout(
            make, self.weights, cfg, rank=d.rank, world_size=d.world_size, tp=tp, turns=turns,
            needs_greedy=self.needs_greedy, engine=engine,
        )  # fmt: skip
        feed = StreamFeed if cfg.rollout.mode == "stream" else TrainerFeed  # docs/async.md
        source = (
            feed(d.split, d.rank, cfg, self.weights, total_steps=self.total_steps, device=self.device) if split else own
        )
        return Sampling(
            cfg, self.data, self.stream, source, own, self.scorer, rank=d.rank, world_size=d.world_size,
            device=self.device, turns=turns, needs_greedy=self.needs_greedy, log=ctx.log,
        )  # fmt: skip

    # ------------------------------------------------------------------ samples

    def sample(self, step: int) -> tuple[RolloutBatch, Metrics]:
        """This rank's scored samples of step ``step`` (:meth:`Sampling.sample`)."""
        return self.sampling.sample(step)

    def pool(self, batch: RolloutBatch) -> RolloutBatch:
        """The samples of every rank that splits this rank's model replica (Megatron: its TP x PP group),
        in rank order: those ranks train on them together. FSDP: the batch itself."""
        if self.actor.mp_size == 1:
            return batch
        parts = all_gather_objects(batch.to("cpu"), self.actor.mp_group)
        return RolloutBatch.join(parts).to(self.device)

    def evaluate(self, step: int) -> dict:
        return self.sampling.evaluate(step)

    # ------------------------------------------------------------------ log-prob passes

    def ref_logprobs(self, batch: RolloutBatch) -> Metrics:
        m: Metrics = {}
        with timed(m, "time/logprobs"):
            batch.ref_logp, _ = compute_logprobs(
                self.ref, batch, temperature=self.algo.temperature, budget=self.budget, pad_id=self.pad_id
            )
        return m

    def old_logprobs(self, batch: RolloutBatch, sampled: bool = True) -> Metrics:
        """The actor's log-probs before the update; compared with the rollout engine's. Skipped when the
        batch gets one optimizer step and no KL term reads them: the update's own forward gives them.
        ``sampled=False`` (the teacher's responses, ``--teacher-data``): nothing to compare them with; they
        become the rows' behaviour log-probs, so every importance weight of the update is 1."""
        if self.ref is None and self.teacher is None and single_step(batch, self.algo) and self.logprobs_checked:
            batch.old_logp = None
            return {}
        m: Metrics = {}
        with timed(m, "time/logprobs"):
            batch.old_logp, entropy = compute_logprobs(
                self.actor,
                batch,
                temperature=self.algo.temperature,
                budget=self.budget,
                pad_id=self.pad_id,
                with_entropy=True,
            )
        if not sampled:
            batch.rollout_logp = batch.old_logp.clone()
            return m
        mask = batch.mask
        s = global_sums(
            {
                "diff": ((batch.old_logp - batch.rollout_logp).abs() * mask).sum(),
                "ent": (entropy * mask).sum(),
                "tok": mask.sum(),
            },
            self.device,
            self.dp_group,
        )
        tokens = max(1.0, s["tok"])
        m["rollout/logprob_diff"] = s["diff"] / tokens
        m["entropy"] = s["ent"] / tokens
        self.warn_logprob_diff(m)
        self.check_logprobs_once(m)
        return m

    def check_logprobs_once(self, metrics: Metrics) -> None:
        """Before the first update of this process: print the mismatch; refuse far beyond the dtype's noise."""
        if self.logprobs_checked:
            return
        self.logprobs_checked = True
        if self._filtered():
            return  # the engine's log-probs are of the top-k/top-p filtered distribution: they differ by design
        diff = metrics.get("rollout/logprob_diff", 0.0)
        self.ctx.log(f"log-prob check: rollout vs trainer differ by {diff:.3g} per token ({self.weights.dtype})")
        problem = logprob_check_problem(diff, self.weights.dtype)
        if problem:
            raise UserError(problem)

    def _filtered(self) -> bool:
        """The rollout engine's log-probs are of the top-k/top-p filtered distribution."""
        r = self.cfg.rollout
        return self.sampling.evaluator.logprobs_filtered and (r.top_k != -1 or r.top_p < 1)

    def warn_logprob_diff(self, metrics: Metrics) -> None:
        if self.sampling.source.stale:
            return  # stale batches: the difference is the staleness (the rollout correction's metrics show it)
        if self._filtered():
            return  # the engine's log-probs are of the top-k/top-p filtered distribution: they differ by design
        if metrics.get("rollout/logprob_diff", 0.0) > LOGPROB_DIFF_WARN:
            self.ctx.log(
                f"warning: the rollout engine's log-probs differ from the trainer's by "
                f"{metrics['rollout/logprob_diff']:.3g} per token on average (weights out of sync, "
                f"or a precision mismatch)"
            )

    def values(self, batch: RolloutBatch) -> Metrics:
        m: Metrics = {}
        with timed(m, "time/logprobs"):
            batch.values = compute_values(self.critic, batch, budget=self.budget, pad_id=self.pad_id)
        return m

    # ------------------------------------------------------------------ advantages

    def advantages(self, batch: RolloutBatch) -> Metrics:
        """Token rewards (minus the KL penalty when algo.kl_in_reward), then algo.adv on the global batch."""
        a = self.algo
        kl, m = None, {}
        if batch.ref_logp is not None:
            kl = kl_estimate(batch.old_logp, batch.ref_logp, a.kl_kind) * batch.mask
            s = global_sums({"kl": kl.sum(), "tok": batch.mask.sum()}, self.device, self.dp_group)
            m["kl"] = s["kl"] / max(1.0, s["tok"])
        coef = self.kl_ctl.value if a.kl_in_reward and kl is not None else 0.0
        rewards = token_rewards(batch, coef, kl)
        batch.advantages, batch.returns = compute_advantages(batch, a, rewards, self.dp_group)
        if self.teacher is not None:  # distillation: the teacher-student log-prob gap, mixed with the task's
            m.update(self.teacher.apply(batch, a.temperature, self.budget, self.pad_id, self.dp_group))
        if self.cfg.algo.overlong_filter:
            m.update(self.filter_overlong(batch))
        if coef:
            m["kl_coef"] = coef
            self.kl_ctl.update(m["kl"], batch.total)
        return m

    def filter_overlong(self, batch: RolloutBatch) -> Metrics:
        """DAPO's overlong filtering: the truncated samples (no stop token within rollout.max_response_len)
        get no loss. Their scores still counted in their groups' advantages; their loss mask is zeroed, so
        the updates skip them (and their tokens leave the denominators). ``response/overlong_filtered``:
        how many, over every rank."""
        s = global_sums({"cut": mask_truncated(batch)}, self.device, self.dp_group)
        return {"response/overlong_filtered": s["cut"]}

    # ------------------------------------------------------------------ updates

    def update_actor(self, batch: RolloutBatch) -> Metrics:
        a = self.algo
        kl_loss_coef = a.kl_coef if self.ref is not None and not a.kl_in_reward else 0.0
        m: Metrics = {}
        with timed(m, "time/update"):
            m.update(
                update_actor(
                    self.actor,
                    batch,
                    self.algo,
                    budget=self.budget,
                    pad_id=self.pad_id,
                    kl_loss_coef=kl_loss_coef,
                    teacher=self.teacher.in_loss if self.teacher is not None else None,
                )
            )
        if batch.old_logp is None:  # the log-prob pass was skipped: the update measured the difference
            self.warn_logprob_diff(m)
        self.weights.stepped()
        return m

    def teacher_data_index(self, step: int) -> int | None:
        """Step ``step``'s index among the steps on ``--teacher-data``'s rows, or None (it samples)."""
        data = self.teacher.data if self.teacher is not None else None
        return data.index(step) if data is not None else None

    def teacher_rows(self, index: int) -> tuple[RolloutBatch, Metrics]:
        """This rank's share of the ``index``-th step on ``--teacher-data``'s rows (GKD's mixture), its advantages
        0: only the full-vocabulary loss trains on them; and their tokens over every rank."""
        n, mini = self.cfg.rollout.n, self.stream.mini_batch_size
        batch = self.teacher.data.batch(
            index, n=n, batch_size=self.stream.batch_size, mini=mini, rank=self.dist.rank,
            world=self.dist.world_size, width=self.cfg.rollout.max_response_len, device=self.device,
        )  # fmt: skip
        batch.advantages = torch.zeros_like(batch.mask)
        return batch, {"tokens": global_sums({"t": float(sum(batch.lengths))}, self.device)["t"]}

    def update_critic(self, batch: RolloutBatch) -> Metrics:
        m: Metrics = {}
        with timed(m, "time/update"):
            m.update(update_critic(self.critic, batch, self.algo, budget=self.budget, pad_id=self.pad_id))
        return m

    # ------------------------------------------------------------------ samples.jsonl

    def write_samples(self, b: RolloutBatch, step: int) -> None:
        """Whole groups of the step's samples ``b`` (rank 0's: every sample of a prompt, so a GRPO group is
        seen side by side; at least ``log.samples`` samples, the groups spread over its prompts) into
        samples.jsonl: prompt, response, reward, advantage (the mean over the response tokens), length, truncated."""
        lg = self.cfg.log
        if not self.dist.is_main or not len(b):
            return
        import json

        adv = (b.advantages * b.mask).sum(-1) / b.mask.sum(-1).clamp(min=1)
        with open(self.ctx.paths.samples, "a") as f:
            for i in sample_rows([int(u) // b.n for u in b.uid.tolist()], lg.samples):
                rec = {
                    "step": step,
                    "prompt": self.tokenizer.decode(b.prompts[i], skip_special_tokens=False),
                    "response": self.tokenizer.decode(b.responses[i], skip_special_tokens=True),
                    "reward": float(b.scores[i]),
                    "advantage": float(adv[i]),
                    "ground_truth": str(b.meta[i].ground_truth) if b.meta else None,
                    "response_len": len(b.responses[i]),
                    "truncated": bool(b.truncated[i]),
                }
                if len(b.reward_parts) == len(b):  # every component, unweighted: the automatic one, an environment's
                    rec["rewards"] = b.reward_parts[i]
                for key, value in self.sampling.turns.logged(b.trajectories[i]).items():  # agent runs: the talk
                    rec.setdefault(key, value)
                f.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ what rlctl.runtime.fit needs

    @property
    def steps_per_epoch(self) -> int:
        return self.stream.steps_per_epoch

    @property
    def num_examples(self) -> int:
        return len(self.data.train)

    @property
    def has_eval(self) -> bool:
        return bool(self.data.val)

    def engines(self) -> dict[str, TrainEngine]:
        return {"": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def train_step(self, step: int) -> dict:
        """The recipe's step ``step`` (0-based) and its metrics record."""
        lr = self.actor.lr
        began = time.perf_counter()
        batch, m = self.recipe_step(self, step)
        m = merged(m, self.sampling.source.after_update(step))  # split runs: the new weights to the rollout processes
        elapsed = time.perf_counter() - began
        every = self.cfg.log.samples_every
        sampled = batch.scores is not None  # (not a step on --teacher-data's rows)
        if sampled and every and (step == 0 or (step + 1) % every == 0 or step + 1 == self.total_steps):
            self.write_samples(batch, step + 1)
        return {
            "step": step + 1,
            "total_steps": self.total_steps,
            **({"reward": m["reward/mean"]} if sampled else {}),
            **{k: m[k] for k in sorted(m)},
            "lr": lr,
            "epoch": round((step + 1) / self.stream.steps_per_epoch, 4),
            "time/step": elapsed,
            "tokens_per_s": m.get("tokens", 0.0) / elapsed,
        }

    def state(self) -> dict:
        return {"kl_coef": self.kl_ctl.value, "data_position": self.stream.cursor, **self.sampling.source.state()}

    def load_state(self, state: dict) -> None:
        self.kl_ctl.value = float(state.get("kl_coef", self.kl_ctl.value))
        self.sampling.source.restore(state)
        self.stream.restore(state.get("data_position"), int(state.get("step", 0)))
        self.sampling.evaluator.weights_unknown()  # the rollout engine still holds the initial weights

    def summary(self) -> dict:
        return {
            "data": self.data.report.to_dict(),
            "prompts_too_long": self.data.too_long,
            "rewards": self.scorer.totals,  # reward/failed and reward/nonfinite samples over the run
            "policy_loss": self.algo.policy.as_metrics(),
        }

    def close(self) -> None:
        s = self.sampling
        s.source.close()
        if s.evaluator is not s.source:
            s.evaluator.close()
        self.scorer.close()


def sample_rows(groups: list[int], at_least: int) -> list[int]:
    """The rows of whole groups (``groups[i]``: row i's prompt), at least ``at_least`` rows when there are,
    the groups spread over the batch (in the batch's order)."""
    order = list(dict.fromkeys(groups))
    size = max(1, len(groups) // max(1, len(order)))
    wanted = min(len(order), max(1, -(-at_least // size)))
    stride = max(1, len(order) // wanted)
    chosen = set(order[::stride][:wanted])
    return [i for i, g in enumerate(groups) if g in chosen]
