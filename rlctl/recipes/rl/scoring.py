"""The trainer's scoring step (:class:`ScoringSteps`, mixed into :class:`rlctl.recipes.rl.trainer.RLTrainer`):
the run's :class:`rlctl.rewards.RewardManager` scores this rank's samples, the sums go over the ranks,
and :func:`rlctl.rewards.reward_metrics` turns them into metrics; plus the response-length metrics."""

from __future__ import annotations

import torch

from rlctl.config import RunConfig
from rlctl.data.rl import Prompt, RLData
from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.runtime.dist import all_gather_objects, all_reduce_max, global_sums


def reward_manager(cfg: RunConfig, data: RLData, tokenizer, device: torch.device):
    """The run's :class:`rlctl.rewards.RewardManager` (all reward logic lives in rlctl/rewards)."""
    import os

    from rlctl.rewards import RewardManager

    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return RewardManager.for_run(cfg, data, tokenizer, device=str(device), local_world=local_world)


class ScoringSteps:
    """The trainer's reward steps; they use its ``tokenizer``, ``rewards``, ``ctx``, ``device`` and ``m``."""

    def _score(
        self, prompts: list[list[int]], responses: list[list[int]], meta: list[Prompt], step: int
    ) -> tuple[torch.Tensor, dict]:
        """Scores of this rank's samples and the global reward metrics (collective): score locally,
        sum the counts over ranks, then :func:`rlctl.rewards.reward_metrics` (which alone decides that
        every sample failed)."""
        from rlctl.rewards import reward_metrics, reward_warning

        result = self.rewards.score(self.rewards.batch(prompts, responses, meta))
        keys = sorted({k for ks in all_gather_objects(sorted(result.sums)) for k in ks})
        sums = global_sums({k: result.sums.get(k, 0.0) for k in keys}, self.device)
        out = reward_metrics(sums, result.errors)  # UserError when every sample failed
        warning = reward_warning(sums, result.errors, step)
        if warning:
            self.ctx.log(warning)
            out["warning"] = warning  # in the step's record: the launcher prints it on the console
        return torch.tensor(result.scores, dtype=torch.float32, device=self.device), out

    def score(self, batch: RolloutBatch, step: int) -> None:
        """Score this rank's samples (before :meth:`pool`, so sums run over every rank); reward and
        response-length metrics."""
        batch.scores, metrics = self._score(batch.prompts, batch.responses, batch.meta, step)
        self.m.update(metrics)
        for key in ("reward/failed", "reward/nonfinite"):  # run totals, for summary.json
            self.reward_totals[key] = self.reward_totals.get(key, 0) + int(metrics[key])
        lengths = batch.mask.sum(-1)
        s = global_sums(
            {
                "len": lengths.sum(),
                "trunc": batch.truncated.sum(),
                "n": len(batch),
                "prompt": sum(len(p) for p in batch.prompts),
            },
            self.device,
        )
        self.m["response_len/mean"] = s["len"] / max(1.0, s["n"])
        self.m["response_len/max"] = float(all_reduce_max(int(lengths.max()) if len(batch) else 0, self.device))
        self.m["response/truncated"] = s["trunc"] / max(1.0, s["n"])
        self.m["tokens"] = s["len"] + s["prompt"]
