"""A step's samples, generated, scored and pooled into a :class:`RolloutBatch`, and validation:
:class:`Sampling`, a part the trainer owns, built with what it reads (the run's settings, its prompts and
their stream, where samples come from, the scorer, the evaluation engine), never the trainer."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from rlctl.algos.shaping import overlong_penalty
from rlctl.config import RunConfig
from rlctl.data.rl import Prompt, RLData
from rlctl.recipes.rl.batch import RolloutBatch, rank_positions
from rlctl.recipes.rl.dynamic import dynamic_sample
from rlctl.recipes.rl.metrics import Metrics, merged, timed
from rlctl.recipes.rl.rollouts import ColocatedRollout, SampleSource
from rlctl.recipes.rl.scoring import RewardScorer, score_greedy
from rlctl.recipes.rl.stream import PromptStream
from rlctl.recipes.rl.turns import MultiTurn, SingleTurn
from rlctl.runtime.dist import global_sums


class Sampling:
    """This rank's samples of a step (from ``source``: its own engine or the rollout processes), scored;
    and validation on ``evaluator`` (the same engine, or in a split run one of its own, made at its first
    use). ``rank`` / ``world_size``: this rank among the trainers."""

    def __init__(
        self,
        cfg: RunConfig,
        data: RLData,
        stream: PromptStream,
        source: SampleSource,
        evaluator: ColocatedRollout,
        scorer: RewardScorer,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        turns: SingleTurn | MultiTurn,
        needs_greedy: bool,
        log: Callable[[str], None],
    ):
        self.cfg, self.data, self.stream, self.source, self.evaluator = cfg, data, stream, source, evaluator
        self.scorer, self.rank, self.world_size, self.device = scorer, rank, world_size, device
        self.turns, self.needs_greedy, self.log = turns, needs_greedy, log  # turns: rl.turns, chosen once

    def sample(self, step: int) -> tuple[RolloutBatch, Metrics]:
        """This rank's scored samples of step ``step``: the sampler's next batch generated and scored, or
        with ``algo.dynamic_sampling`` as many batches as fill it with groups whose scores differ
        (:mod:`rlctl.recipes.rl.dynamic`)."""
        a = self.cfg.algo
        if a.dynamic_sampling:  # the engine stays awake through the rounds: no update between

            def one_round(indices: list[int], draw: int) -> tuple[RolloutBatch, Metrics]:
                batch, generated = self.generate(indices, draw)
                return batch, {**generated, **self.score(batch, step)}

            batch, m = dynamic_sample(
                one_round,
                self.stream,
                n=self.cfg.rollout.n,
                max_rounds=a.dynamic_max_rounds,
                step=step,
                log=self.log,
            )
            with timed(m, "time/rollout"):
                self.source.sleep()
            return batch, m
        batch, generated = self.generate(self.stream.step(step), step)
        with timed(generated, "time/rollout"):
            self.source.sleep()
        return batch, merged(generated, self.score(batch, step))

    def generate(self, indices: list[int], draw: int) -> tuple[RolloutBatch, Metrics]:
        """This rank's share of the prompts ``indices`` (a step's batch, or a round of dynamic sampling),
        ``rollout.n`` samples each; ``draw`` (the step, or the round's stream position) seeds the sampling.
        The engine is left awake (the caller puts it to sleep)."""
        n, tp, mini = self.cfg.rollout.n, self.evaluator.tp, self.stream.mini_batch_size

        def positions_of(rank: int) -> list[int]:
            return rank_positions(len(indices), mini, rank, self.world_size)

        first = self.rank - self.rank % tp  # this rank's rollout group: rollout.tp consecutive ranks
        shares = [[self.data.train[indices[p]] for p in positions_of(r)] for r in range(first, first + tp)]
        positions, prompts = positions_of(self.rank), shares[self.rank - first]
        m = {"time/weight_sync": 0.0}  # stays 0 when the weights are current (first step, after an eval)
        samples, greedy = self.source.samples(shares, n, draw, m)
        trajs = self.turns.trajectories(samples, prompts)  # a single-turn sample: a trajectory of one turn
        seen: dict[int, int] = {}
        uid = []
        for t in trajs:
            j = seen.get(t.prompt_index, 0)
            seen[t.prompt_index] = j + 1
            uid.append(positions[t.prompt_index] * n + j)
        batch = RolloutBatch.build(
            [t.prompt_ids for t in trajs],
            [t.token_ids for t in trajs],
            [t.logprobs for t in trajs],
            uid,
            n=n,
            batch_size=len(indices),
            mini_batch_size=mini,
            width=self.cfg.rollout.max_response_len,
            truncated=[t.truncated for t in trajs],
            meta=[prompts[t.prompt_index] for t in trajs],
            device=self.device,
            loss_masks=[t.mask for t in trajs],
            trajectories=trajs,
        )
        greedy = self.turns.trajectories(greedy, prompts)
        by_prompt = {g.prompt_index: g for g in greedy}
        batch.greedy = [by_prompt[s.prompt_index] for s in samples] if greedy else []
        return batch, m

    def score(self, batch: RolloutBatch, step: int) -> Metrics:
        """Score this rank's samples (before the trainer pools them, so sums run over every rank): reward
        and response-length metrics."""
        batch.scores, metrics = self.scorer.score_batch(batch, step, self.turns)
        penalty = self.overlong(batch.mask.sum(-1))
        if penalty is not None:
            batch.scores = batch.scores + penalty.to(batch.scores.dtype)
            s = global_sums({"p": penalty.sum(), "n": float(len(penalty))}, self.device)  # before pool: every rank
            metrics["reward/overlong_penalty"] = s["p"] / max(1.0, s["n"])
        if self.needs_greedy:
            metrics.update(score_greedy(self.scorer, batch, step, self.overlong, self.turns))
        return metrics

    def overlong(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """DAPO's soft overlong punishment of responses of ``lengths`` sampled tokens (rlctl.algos.shaping);
        None when off (``algo.overlong_buffer`` 0)."""
        a = self.cfg.algo
        if not a.overlong_buffer:
            return None
        return overlong_penalty(lengths, self.cfg.rollout.max_response_len, a.overlong_buffer, a.overlong_factor)

    # ------------------------------------------------------------------ evaluation

    def _eval_generate(self, step: int, n: int, temperature: float) -> tuple[list, list[Prompt]]:
        """This rank's validation samples (``n`` per prompt) and its prompts; the engine stays awake."""
        ev = self.evaluator
        tp = ev.tp
        group_prompts = self.data.val[self.rank // tp :: self.world_size // tp]
        shares = [group_prompts[i::tp] for i in range(tp)]
        ev.wake({})  # (an eval's weight sync is not a training step's time; none for a second pass)
        samples = ev.generate(shares, n, ev.params(step, temperature=temperature, seed_offset=1))
        return samples, shares[self.rank % tp]

    def _eval_score(self, step: int, samples: list, mine: list[Prompt]):
        """Scores of validation samples: (their scores, their prompt indices, the global reward metrics,
        this rank's prompt count)."""
        trajs = self.turns.trajectories(samples, mine)
        scores, metrics = self.scorer.score(
            [t.prompt_ids for t in trajs],
            [t.token_ids for t in trajs],
            [mine[t.prompt_index] for t in trajs],
            step,
            self.turns.for_reward(trajs),
        )
        return scores.tolist(), [t.prompt_index for t in trajs], metrics, len(mine)

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
        self.evaluator.sleep()
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
