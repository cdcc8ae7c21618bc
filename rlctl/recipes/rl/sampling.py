"""The sampling half of :class:`~rlctl.recipes.rl.trainer.RLTrainer`: its rollout engine (made, woken with
the actor's weights, put to sleep), a step's samples generated, scored and pooled, and validation.

:class:`Sampling` holds no state of its own: ``RLTrainer.__init__`` sets what it reads (cfg, dist, data,
sampler, scorer, actor, rollout, rollout_tp, rollout_dtype, rollout_path, agent_loop, feed, ...)."""

from __future__ import annotations

import math
import time

import torch

from rlctl.algos.shaping import overlong_penalty
from rlctl.data.rl import Prompt
from rlctl.errors import UserError
from rlctl.recipes.rl.agent import run_agent
from rlctl.recipes.rl.batch import RolloutBatch, rank_positions, sampling_params
from rlctl.recipes.rl.dynamic import dynamic_sample
from rlctl.recipes.rl.metrics import Metrics, merged, timed
from rlctl.recipes.rl.scoring import score_greedy
from rlctl.rollout import RolloutSpec
from rlctl.runtime.dist import all_gather_objects, check_rollout_in_node, global_sums


def prompt_images(prompts: list[Prompt]) -> list | None:
    """Each prompt's images for the rollout engine (None for a prompt without); None when no prompt has any."""
    images = [(p.pixel_values, p.image_grid_thw) if p.pixel_values is not None else None for p in prompts]
    return images if any(im is not None for im in images) else None


class Sampling:
    """RLTrainer's steps and helpers that generate, score and pool samples, and evaluate."""

    def _rollout_path(self) -> str:
        """The model the rollout engines load first (collective when the model is randomly initialised)."""
        if self.source.random_init:  # no weights on disk: the rollout engine starts from the actor's
            return str(self.actor.export_hf(self.ctx.paths.root / "rollout_init", self.ctx.paths.model_meta))
        return self.source.path

    def _make_rollout(self):
        """This rank's rollout engine: the run's RolloutSpec with this rank's weights, device, dtype and seed."""
        from rlctl.rollout import make_rollout_engine

        d = self.dist
        spec = RolloutSpec.from_config(self.cfg)
        beside = ""
        if self.feed is not None:  # a split run's evaluation engine: on a trainer GPU, beside its states
            spec = spec.replace(mem_fraction=self.cfg.rollout.eval_mem_fraction or spec.mem_fraction)
            beside = f", memory fraction {spec.mem_fraction:.2f} beside the trainer (rollout.eval_mem_fraction)"
        path = self.rollout_path
        if d.world_size % self.rollout_tp:
            raise UserError(f"rollout.tp={self.rollout_tp} does not divide the {d.world_size} processes")
        check_rollout_in_node(self.rollout_tp, d.local_world_size)
        engine = make_rollout_engine(
            spec.replace(
                model_path=path,
                device=f"cuda:{d.local_rank}" if self.device.type == "cuda" else "cpu",
                dtype=self.rollout_dtype,
                seed=spec.seed + d.rank,
            )
        )
        self.ctx.log(f"rollout: {spec.engine} engine on every rank ({self.rollout_dtype}){beside}")
        return engine

    # ------------------------------------------------------------------ rollout

    def _sampling(self, step: int, *, temperature: float, seed_offset: int = 0):
        """Sampling parameters with a seed of its own for each (step, rollout group)."""
        d, tp = self.dist, self.rollout_tp
        return sampling_params(
            self.cfg, step, d.rank // tp, d.world_size // tp, temperature=temperature, seed_offset=seed_offset
        )

    def _rollout(self, shares: list[list[Prompt]], n: int, sampling) -> list:
        """This rank's samples (:meth:`_group_generate`), or its multi-turn trajectories in agent runs."""
        if self.agent_loop is None:
            return self._group_generate(shares, n, sampling)
        return run_agent(self.agent_loop, self.cfg, self.rollout, shares[0], n, sampling)

    def _group_generate(self, shares: list[list[Prompt]], n: int, sampling) -> list:
        """Samples of this rank's prompts. ``shares[i]`` are the prompts of the i-th rank of this rank's
        rollout group (``rollout.tp`` consecutive ranks): a vLLM tensor-parallel group must generate the
        same requests on all its ranks, so the group generates every share and each rank keeps its own
        (``prompt_index`` relative to its share)."""
        from dataclasses import replace

        own = self.dist.rank % self.rollout_tp
        prompts = [p for share in shares for p in share]
        everything = [p.token_ids for p in prompts]
        samples = self.rollout.generate(everything, n, sampling, images=prompt_images(prompts)) if everything else []
        start = sum(len(share) for share in shares[:own])
        return [
            replace(s, prompt_index=s.prompt_index - start)
            for s in samples
            if start <= s.prompt_index < start + len(shares[own])
        ]

    def _wake_and_sync(self, metrics: Metrics) -> None:
        """Wake the rollout engine's weights, load the actor's into it when they are not current (the
        actor's ``weights_version`` moved since the engine's last sync, or the engine dropped its weights
        asleep; ``time/weight_sync``), then wake its KV cache. An engine still awake with the current
        weights (the rounds of dynamic sampling, the passes of an evaluation) does nothing."""
        from rlctl.rollout.base import torch_dtype

        if self.rollout is None:  # a split run's first evaluation
            self.rollout = self._make_rollout()
        if self.rollout_version != self.weights_version:
            self.rollout.trainer_stepped()

        def sync() -> None:
            with timed(metrics, "time/weight_sync"):
                self.rollout.update_weights(self.actor.iter_full_params(dtype=torch_dtype(self.rollout_dtype)))

        self.rollout.ready(sync)
        self.rollout_version = self.weights_version

    def _sleep(self) -> None:
        """The rollout phase is over: the engine gives the accelerator back (it may drop its weights)."""
        if self.rollout is not None:
            self.rollout.sleep()

    def sample(self, step: int) -> tuple[RolloutBatch, Metrics]:
        """This rank's scored samples of step ``step``: the sampler's next batch generated and scored, or
        with ``algo.dynamic_sampling`` as many batches as fill it with groups whose scores differ
        (:mod:`rlctl.recipes.rl.dynamic`)."""
        if self.cfg.algo.dynamic_sampling:  # the engine stays awake through the rounds: no update between
            batch, m = dynamic_sample(self, step)
            with timed(m, "time/rollout"):
                self._sleep()
            return batch, m
        batch, generated = self.generate(self.sampler.indices(step), step)
        with timed(generated, "time/rollout"):
            self._sleep()
        self.cursor = self.sampler.first(step + 1)
        return batch, merged(generated, self.score(batch, step))

    def generate(self, indices: list[int], draw: int) -> tuple[RolloutBatch, Metrics]:
        """This rank's share of the prompts ``indices`` (a step's batch, or a round of dynamic sampling),
        ``rollout.n`` samples each; ``draw`` (the step, or the round's stream position) seeds the sampling.
        The engine is left awake (the caller puts it to sleep: :meth:`_sleep`)."""
        d, n = self.dist, self.cfg.rollout.n

        def positions_of(rank: int) -> list[int]:
            return rank_positions(len(indices), self.mini_batch_size, rank, d.world_size)

        first = d.rank - d.rank % self.rollout_tp  # this rank's rollout group: rollout.tp consecutive ranks
        shares = [[self.data.train[indices[p]] for p in positions_of(r)] for r in range(first, first + self.rollout_tp)]
        positions, prompts = positions_of(d.rank), shares[d.rank - first]
        m = {"time/weight_sync": 0.0}  # stays 0 when the weights are current (first step, after an eval)
        greedy = []
        if self.feed is not None:  # generated by a rollout process (rlctl.recipes.rl.offpolicy)
            samples = self.feed.receive(draw, m)
        else:
            self._wake_and_sync(m)
            with timed(m, "time/rollout"):
                samples = self._rollout(shares, n, self._sampling(draw, temperature=self.cfg.rollout.temperature))
                if self.needs_greedy:  # remax: one greedy response per prompt, its score the baseline
                    greedy = self._rollout(shares, 1, self._sampling(draw, temperature=0.0, seed_offset=1))
        seen: dict[int, int] = {}
        uid = []
        for s in samples:
            j = seen.get(s.prompt_index, 0)
            seen[s.prompt_index] = j + 1
            uid.append(positions[s.prompt_index] * n + j)
        agent = self.agent_loop is not None
        batch = RolloutBatch.build(
            [s.prompt_ids if agent else prompts[s.prompt_index].token_ids for s in samples],
            [s.token_ids for s in samples],
            [s.logprobs for s in samples],
            uid,
            n=n,
            batch_size=len(indices),
            mini_batch_size=self.mini_batch_size,
            width=self.cfg.rollout.max_response_len,
            truncated=[s.finish_reason == "length" for s in samples],
            meta=[prompts[s.prompt_index] for s in samples],
            device=self.device,
            loss_masks=[s.mask for s in samples] if agent else None,
            trajectories=samples if agent else None,
        )
        by_prompt = {g.prompt_index: g for g in greedy}
        batch.greedy = [by_prompt[s.prompt_index] for s in samples] if greedy else []
        return batch, m

    def score(self, batch: RolloutBatch, step: int) -> Metrics:
        """Score this rank's samples (before :meth:`pool`, so sums run over every rank): reward and
        response-length metrics."""
        batch.scores, metrics = self.scorer.score_batch(batch, step)
        penalty = self.overlong(batch.mask.sum(-1))
        if penalty is not None:
            batch.scores = batch.scores + penalty.to(batch.scores.dtype)
            s = global_sums({"p": penalty.sum(), "n": float(len(penalty))}, self.device)  # before pool: every rank
            metrics["reward/overlong_penalty"] = s["p"] / max(1.0, s["n"])
        if self.needs_greedy:
            metrics.update(score_greedy(self.scorer, batch, step, self.overlong))
        return metrics

    def overlong(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """DAPO's soft overlong punishment of responses of ``lengths`` sampled tokens (rlctl.algos.shaping);
        None when off (``algo.overlong_buffer`` 0)."""
        a = self.cfg.algo
        if not a.overlong_buffer:
            return None
        return overlong_penalty(lengths, self.cfg.rollout.max_response_len, a.overlong_buffer, a.overlong_factor)

    def pool(self, batch: RolloutBatch) -> RolloutBatch:
        """The samples of every rank that splits this rank's model replica (Megatron: its TP x PP group),
        in rank order: those ranks train on them together. FSDP: the batch itself."""
        if self.actor.mp_size == 1:
            return batch
        parts = all_gather_objects(batch.to("cpu"), self.actor.mp_group)
        return RolloutBatch.join(parts).to(self.device)

    # ------------------------------------------------------------------ evaluation

    def _eval_generate(self, step: int, n: int, temperature: float) -> tuple[list, list[Prompt]]:
        """This rank's validation samples (``n`` per prompt) and its prompts; the engine stays awake."""
        d, tp = self.dist, self.rollout_tp
        group_prompts = self.data.val[d.rank // tp :: d.world_size // tp]
        shares = [group_prompts[i::tp] for i in range(tp)]
        self._wake_and_sync({})  # (an eval's weight sync is not a training step's time; none for a second pass)
        samples = self._rollout(shares, n, self._sampling(step, temperature=temperature, seed_offset=1))
        return samples, shares[d.rank % tp]

    def _eval_score(self, step: int, samples: list, mine: list[Prompt]):
        """Scores of validation samples: (their scores, their prompt indices, the global reward metrics,
        this rank's prompt count)."""
        picked = [mine[s.prompt_index] for s in samples]
        agent = self.agent_loop is not None
        scores, metrics = self.scorer.score(
            [s.prompt_ids if agent else p.token_ids for s, p in zip(samples, picked)],
            [s.token_ids for s in samples],
            picked,
            step,
            samples if agent else None,
        )
        return scores.tolist(), [s.prompt_index for s in samples], metrics, len(mine)

    def evaluate(self, step: int) -> dict:
        """Validation: one sample per prompt at rollout.val_temperature (0: greedy) -> ``val/reward/mean``
        and ``val/acc`` (binary rewards); with rollout.val_n = k > 1 also k samples per prompt at the
        training temperature -> ``val/mean@k`` (mean reward of the k samples, averaged over prompts) and
        ``val/pass@k`` (share of prompts with at least one of the k samples scoring >= 1, a correct answer
        of gsm8k / math / exact). Both passes generate with the engine awake once, then it sleeps and the
        samples are scored."""
        r = self.cfg.rollout
        began = time.perf_counter()
        k = r.val_n
        first = self._eval_generate(step, 1, r.val_temperature)
        second = self._eval_generate(step, k, r.temperature or 1.0) if k > 1 else None
        self._sleep()
        _, _, metrics, _ = self._eval_score(step, *first)
        out = {"step": step, "kind": "eval", "val/reward/mean": metrics["reward/mean"]}
        if "acc" in metrics:
            out["val/acc"] = metrics["acc"]
        if second is not None:
            scores, index, metrics, n_prompts = self._eval_score(step, *second)
            best: dict[int, float] = {}
            for score, i in zip(scores, index):
                best[i] = max(best.get(i, -math.inf), score)
            solved = sum(v >= 1.0 for v in best.values())
            s = global_sums({"solved": float(solved), "prompts": float(n_prompts)}, self.device)
            out[f"val/mean@{k}"] = metrics["reward/mean"]
            out[f"val/pass@{k}"] = s["solved"] / max(1.0, s["prompts"])
        out["time/eval"] = time.perf_counter() - began
        return out
