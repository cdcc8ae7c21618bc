"""In-process rollout with plain transformers and a decoding loop of our own.

Why not ``model.generate``: we want the exact per-token log-probabilities of our convention (see
:mod:`rlctl.rollout.base`) and a prompt that is prefilled once for its whole group of ``n``
samples. The loop:

1. left-pad the prompts and prefill them in one forward pass (one row per prompt);
2. repeat each row's KV cache ``n`` times (``Cache.batch_repeat_interleave``), so a group of ``n``
   samples shares one prefill;
3. decode one token per step for every unfinished sample, dropping finished rows from the batch
   and the cache as they stop.

Left padding is handled with an attention mask (pads are never attended to) and explicit position
ids that start at 0 on each prompt's first real token, so a padded prompt sees exactly what it
would see alone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from rlctl.errors import UserError, did_you_mean
from rlctl.rollout.base import (
    RolloutEngine,
    Sample,
    SamplingParams,
    check_generate_args,
    default_stop_token_ids,
    torch_dtype,
)


class HFRolloutEngine(RolloutEngine):
    """Generation with a private copy of the HF model on one device."""

    name = "hf"
    supports_sleep = False

    def __init__(
        self,
        model_path: str,
        *,
        device: str,
        dtype: str,
        tp: int = 1,
        mem_fraction: float = 0.5,
        max_model_len: int,
        seed: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        # mem_fraction does not apply; the n samples of a prompt always share its prefill.
        if tp != 1:
            raise UserError(f"the hf rollout engine runs on one device; use tp=1 (got tp={tp}) or the vllm engine")
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype(dtype))
        self.model.to(self.device).eval().requires_grad_(False)
        self.stop_token_ids = default_stop_token_ids(model_path)
        self.pad_token_id = 0  # any id works: padded positions are masked out
        self._generator = torch.Generator(self.device).manual_seed(seed)
        # state_dict() tensors share storage with the model's parameters: copying into them
        # updates the model in place.
        self._tensors = self.model.state_dict()

    @torch.no_grad()
    def _generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[Sample]:
        check_generate_args(prompt_token_ids, n, self.max_model_len)
        stop_ids = self.stop_token_ids | set(sampling.stop_token_ids or ())
        generator = self._generator
        if sampling.seed is not None:
            generator = torch.Generator(self.device).manual_seed(sampling.seed)

        input_ids, attention_mask = left_pad(prompt_token_ids, self.pad_token_id, self.device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        # One prefill per prompt; its cache is shared by the prompt's n samples.
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].repeat_interleave(n, dim=0)
        attention_mask = attention_mask.repeat_interleave(n, dim=0)
        next_position = position_ids[:, -1].repeat_interleave(n, dim=0) + 1

        num_samples = len(prompt_token_ids) * n
        budget = [
            min(sampling.max_tokens, self.max_model_len - len(prompt_token_ids[s // n])) for s in range(num_samples)
        ]
        tokens: list[list[int]] = [[] for _ in range(num_samples)]
        logprobs: list[list[float]] = [[] for _ in range(num_samples)]
        finish: list[str | None] = [None] * num_samples
        rows = torch.arange(num_samples)  # sample index of each row still decoding

        while True:
            next_tokens, next_logprobs = sample_next_token(logits, sampling, generator)
            for s, token, logprob in zip(rows.tolist(), next_tokens.tolist(), next_logprobs.tolist()):
                tokens[s].append(token)
                logprobs[s].append(logprob)
                if token in stop_ids:
                    finish[s] = "stop"
                elif len(tokens[s]) >= budget[s]:
                    finish[s] = "length"
            alive = torch.tensor([finish[s] is None for s in rows.tolist()])
            if not alive.any():
                break
            if not alive.all():
                rows = rows[alive]
                keep = alive.nonzero().squeeze(1).to(self.device)
                cache.batch_select_indices(keep)
                next_tokens = next_tokens[keep]
                attention_mask = attention_mask[keep]
                next_position = next_position[keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
            out = self.model(
                input_ids=next_tokens[:, None],
                attention_mask=attention_mask,
                position_ids=next_position[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1]
            next_position = next_position + 1

        return [
            Sample(s // n, tokens[s], logprobs[s], finish[s])  # type: ignore[arg-type]
            for s in range(num_samples)
        ]

    @torch.no_grad()
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            target = self._tensors.get(name)
            if target is None:
                raise UserError(f"the hf rollout model has no parameter {name!r}{did_you_mean(name, self._tensors)}")
            if target.shape != tensor.shape:
                raise UserError(
                    f"parameter {name!r} has shape {tuple(tensor.shape)}, the rollout model "
                    f"expects {tuple(target.shape)}"
                )
            target.copy_(tensor)

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
        self._tensors = {}


def left_pad(prompts: list[list[int]], pad_token_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (len(prompts), longest prompt), padded on the left."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), attention_mask.to(device)


def sample_next_token(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` (rows, vocab); return (tokens, their log-probs).

    The log-prob is ``log_softmax(logits / temperature)`` at the drawn token, before top-k/top-p
    (``log_softmax(logits)`` when greedy).
    """
    logits = logits.float()
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = logits.log_softmax(dim=-1)
    else:
        scaled = logits / sampling.temperature
        logprobs = scaled.log_softmax(dim=-1)
        filtered = filter_top_k_top_p(scaled, sampling.top_k, sampling.top_p)
        tokens = torch.multinomial(filtered.softmax(dim=-1), 1, generator=generator).squeeze(1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(1)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set to -inf every logit outside the top-k, then outside the top-p nucleus of what is left.

    The nucleus is the smallest set of most likely tokens whose probability reaches ``top_p``
    (the most likely token is always kept). ``top_k == -1`` and ``top_p == 1`` disable each filter.
    """
    if 0 < top_k < logits.shape[-1]:
        kth_largest = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits
