"""Rewards: the reward function of each sample (:class:`Rewards`) and the trainer's scoring step
(:class:`ScoringSteps`, mixed into :class:`rlctl.recipes.rl.trainer.RLTrainer`): scores and the
global reward and response-length metrics."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlctl.config import RunConfig
from rlctl.data.rl import Prompt, RLData
from rlctl.errors import UserError
from rlctl.recipes.rl.batch import RolloutBatch
from rlctl.runtime.dist import all_gather_objects, all_reduce_max, global_sums


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


class Rewards:
    """The reward function of each sample: ``reward.fn``, or the built-in for the row's data_source."""

    def __init__(self, cfg: RunConfig, data: RLData):
        from rlctl.rewards import BUILTINS, default_for_data_source, get_reward

        self.spec = cfg.reward.fn
        if self.spec != "auto":
            fn = get_reward(self.spec)  # fails now, not after the model is loaded, when the name is wrong
            self.fn_of: Callable[[str], Callable] = lambda _source: fn
            return
        fns = {}
        for source in sorted({p.data_source for p in data.train + data.val}):
            name = default_for_data_source(source)
            if name is None:
                what = f"no built-in reward for data_source {source!r}" if source else "rows without a data_source"
                raise UserError(f"{what}: pass --reward with one of {', '.join(BUILTINS)}, or path/to/file.py:function")
            fns[source] = get_reward(name)
        self.fn_of = fns.__getitem__

    def score(self, texts: list[str], meta: list[Prompt]) -> tuple[list[float], int, str | None, dict[str, list]]:
        """Local scores, error count, first error and extra metrics (lists aligned with the samples)."""
        from rlctl.rewards import score_batch

        scores = [0.0] * len(texts)
        errors, first = 0, None
        extras: dict[str, list] = {}
        groups: dict[int, list[int]] = {}
        fns = {}
        for i, p in enumerate(meta):
            fn = self.fn_of(p.data_source)
            fns[id(fn)] = fn
            groups.setdefault(id(fn), []).append(i)
        for key, idx in groups.items():
            try:
                s, ex, n_err, err = score_batch(
                    fns[key],
                    [meta[i].data_source for i in idx],
                    [texts[i] for i in idx],
                    [meta[i].ground_truth for i in idx],
                    [meta[i].extra_info for i in idx],
                )
            except UserError as e:  # failed on every sample of this group
                s, ex, n_err, err = [0.0] * len(idx), {}, len(idx), str(e)
            for i, v in zip(idx, s):
                scores[i] = v
            for k, vals in ex.items():
                col = extras.setdefault(k, [None] * len(texts))
                for i, v in zip(idx, vals):
                    col[i] = v
            errors += n_err
            first = first or err
        return scores, errors, first, extras


class ScoringSteps:
    """The trainer's reward steps; they use its ``tokenizer``, ``rewards``, ``ctx``, ``device`` and ``m``."""

    def _score(self, responses: list[list[int]], meta: list[Prompt], step: int) -> tuple[torch.Tensor, dict]:
        """Scores of this rank's samples and the global reward metrics (collective)."""
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        scores, errors, first, extras = self.rewards.score(texts, meta)
        local = {
            "n": len(scores),
            "errors": errors,
            "first": first,
            "extras": {
                k: (sum(v for v in vals if v is not None), sum(v is not None for v in vals))
                for k, vals in extras.items()
            },
        }
        everyone = all_gather_objects(local)
        total = sum(o["n"] for o in everyone)
        n_errors = sum(o["errors"] for o in everyone)
        first_error = next((o["first"] for o in everyone if o["first"]), None)
        if total and n_errors == total:
            raise UserError(_one_line(first_error))
        if n_errors:
            self.ctx.log(
                f"warning: step {step + 1}: the reward function failed on {n_errors} of {total} samples "
                f"(scored 0); first: {_one_line(first_error)}"
            )
        t = torch.tensor(scores, dtype=torch.float32, device=self.device)
        s = global_sums(
            {"sum": t.sum(), "sq": (t * t).sum(), "n": len(scores), "nonbinary": ((t != 0) & (t != 1)).sum()},
            self.device,
        )
        n = max(1.0, s["n"])
        mean = s["sum"] / n
        out = {
            "reward/mean": mean,
            "reward/std": math.sqrt(max(0.0, s["sq"] / n - mean * mean)),
            "reward/errors": n_errors,
        }
        if s["nonbinary"] == 0:
            out["acc"] = mean
        keys = sorted({k for o in everyone for k in o["extras"]})
        for k in keys:
            total_k = sum(o["extras"].get(k, (0.0, 0))[0] for o in everyone)
            count_k = sum(o["extras"].get(k, (0.0, 0))[1] for o in everyone)
            out[f"reward/{k}"] = total_k / max(1, count_k)
        return t, out

    def score(self, batch: RolloutBatch, step: int) -> None:
        """Score this rank's samples (before :meth:`pool`, so sums run over every rank); reward and
        response-length metrics."""
        batch.scores, metrics = self._score(batch.responses, batch.meta, step)
        self.m.update(metrics)
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
