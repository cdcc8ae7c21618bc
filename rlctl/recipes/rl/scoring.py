"""The run's reward scorer, a component the trainer owns (:class:`RewardScorer`): the run's
:class:`rlctl.rewards.RewardManager` scores this rank's samples, the sums go over the ranks, and
:func:`rlctl.rewards.reward_metrics` turns them into metrics; plus the response-length metrics of a
batch (:func:`response_metrics`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from rlctl.config import RunConfig
from rlctl.data.rl import Prompt, RLData
from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.runtime.dist import all_gather_objects, all_reduce_max, global_sums


class RewardScorer:
    """Scores samples with the run's reward manager (all reward logic lives in rlctl/rewards) and keeps
    the run's totals of failed and non-finite rewards (for summary.json)."""

    def __init__(self, manager, device: torch.device, log: Callable[[str], None]):
        self.manager, self.device, self.log = manager, device, log
        self.totals: dict[str, int] = {}  # reward/failed and reward/nonfinite samples over the run

    @classmethod
    def for_run(cls, cfg: RunConfig, data: RLData, tokenizer, device: torch.device, log: Callable[[str], None]):
        from rlctl.rewards import RewardManager

        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        manager = RewardManager.for_run(cfg, data, tokenizer, device=str(device), local_world=local_world)
        return cls(manager, device, log)

    def score(
        self,
        prompts: list[list[int]],
        responses: list[list[int]],
        meta: list[Prompt],
        step: int,
        trajectories: list | None = None,
        parts: list | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores of this rank's samples and the global reward metrics (collective): score locally,
        sum the counts over ranks, then :func:`rlctl.rewards.reward_metrics` (which alone decides that
        every sample failed). ``parts``, when given, gets each sample's component values."""
        from rlctl.rewards import reward_metrics, reward_warning

        result = self.manager.score(self.manager.batch(prompts, responses, meta, trajectories))
        if parts is not None:
            parts.extend(result.parts)
        keys = sorted({k for ks in all_gather_objects(sorted(result.sums)) for k in ks})
        sums = global_sums({k: result.sums.get(k, 0.0) for k in keys}, self.device)
        out = reward_metrics(sums, result.errors)  # UserError when every sample failed
        warning = reward_warning(sums, result.errors, step)
        if warning:
            self.log(warning)
            out["warning"] = warning  # type: ignore[assignment] (in the step's record: the launcher prints it)
        return torch.tensor(result.scores, dtype=torch.float32, device=self.device), out

    def score_batch(self, batch: RolloutBatch, step: int, turns) -> tuple[torch.Tensor, dict[str, float]]:
        """This rank's samples of a training step (scored before pooling, so sums run over every rank):
        their scores, and the reward, response-length and (``turns``, rl.turns) turn metrics (collective)."""
        batch.reward_parts = []
        trajs = turns.for_reward(batch.trajectories)
        scores, metrics = self.score(batch.prompts, batch.responses, batch.meta, step, trajs, batch.reward_parts)
        for key in ("reward/failed", "reward/nonfinite"):
            self.totals[key] = self.totals.get(key, 0) + int(metrics[key])
        return scores, {
            **metrics,
            **response_metrics(batch, self.device),
            **turns.metrics(batch.trajectories, self.device),
        }

    def close(self) -> None:
        self.manager.close()


def score_greedy(
    scorer: RewardScorer, batch: RolloutBatch, step: int, shaping: Callable[[torch.Tensor], torch.Tensor | None], turns
) -> dict[str, float]:
    """``batch.baselines``: the score of each row's prompt's greedy response (``batch.greedy``; scored once
    per prompt, then ``shaping``'s length penalty as the samples get it), for remax (collective).
    ``reward/greedy_baseline``: their mean over every rank (the overlong penalty included, when on)."""
    keys = (batch.uid // batch.n).tolist()
    first: dict[int, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    rows = list(first.values())
    greedy = [batch.greedy[i] for i in rows]
    scores, _ = scorer.score(
        [g.prompt_ids for g in greedy],
        [g.token_ids for g in greedy],
        [batch.meta[i] for i in rows],
        step,
        turns.for_reward(greedy),
    )
    lengths = [float(sum(g.mask)) for g in greedy]  # sampled tokens: a tool turn's are not the policy's
    penalty = shaping(torch.tensor(lengths, device=scores.device))
    if penalty is not None:
        scores = scores + penalty.to(scores.dtype)
    by_key = dict(zip(first, scores.tolist()))
    batch.baselines = torch.tensor([by_key[k] for k in keys], dtype=torch.float32, device=batch.mask.device)
    s = global_sums({"sum": scores.sum(), "n": float(len(rows))}, scorer.device)
    return {"reward/greedy_baseline": s["sum"] / max(1.0, s["n"])}


def response_metrics(batch: RolloutBatch, device: torch.device) -> dict[str, float]:
    """Response lengths (mean, standard deviation over the samples, max), the share truncated, and the
    step's tokens, over every rank (collective)."""
    lengths = torch.tensor([float(len(r)) for r in batch.responses], device=device)  # tool turns included
    s = global_sums(
        {
            "len": lengths.sum(),
            "sq": (lengths**2).sum(),
            "trunc": batch.truncated.sum(),
            "n": len(batch),
            "prompt": sum(len(p) for p in batch.prompts),
        },
        device,
    )
    n = max(1.0, s["n"])
    mean = s["len"] / n
    return {
        "response_len/mean": mean,
        "response_len/std": math.sqrt(max(0.0, s["sq"] / n - mean * mean)),
        "response_len/max": float(all_reduce_max(int(lengths.max()) if len(batch) else 0, device)),
        "response/truncated": s["trunc"] / n,
        "tokens": s["len"] + s["prompt"],
    }


def agent_metrics(trajectories: list, device: torch.device) -> dict[str, float]:
    """turns/mean and the tool counts of a step's trajectories, over every rank (collective)."""
    s = global_sums(
        {
            "n": float(len(trajectories)),
            "turns": float(sum(t.turns for t in trajectories)),
            "calls": float(sum(t.tool_calls for t in trajectories)),
            "errors": float(sum(t.tool_errors for t in trajectories)),
            "timeouts": float(sum(t.tool_timeouts for t in trajectories)),
            "malformed": float(sum(t.malformed for t in trajectories)),
            "context": float(sum(len(t.mask) - sum(t.mask) for t in trajectories)),
        },
        device,
    )
    n = max(1.0, s["n"])
    return {
        "turns/mean": s["turns"] / n,
        "tool/calls": s["calls"],
        "tool/errors": s["errors"],
        "tool/timeouts": s["timeouts"],
        "tool/malformed": s["malformed"],
        "response/context_tokens": s["context"] / n,
    }
