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

Steps 1-3 have two implementations with the same bookkeeping and sampler: the HF model's forward with
a ``DynamicCache`` (any architecture), and, for Llama-family models, the prefill and decode step of
:mod:`rlctl.rollout.hf_decode` (preallocated cache, fused projections); the engine takes the fast one
when :func:`~rlctl.rollout.hf_decode.unsupported_reason` has nothing against the model.

Vision-language models (Qwen2-VL, Qwen2.5-VL): the prefill runs through the whole model with the prompts'
images (``pixel_values``, ``image_grid_thw``: what the trainer's forward gets) and the multimodal rope
positions of the model's own ``get_rope_index`` (left padding masked out, so a padded prompt is positioned
as it would be alone); the response's tokens are text, positioned after the prompt's largest position on all
three rope axes, which the text model does from one position per token. A group of ``n`` samples shares its
prompt's prefill, images included. The decode steps are the fast decode step's where it covers the text model
(Qwen2-VL's and Qwen2.5-VL's are Qwen2's: the prefill's keys and values are copied into its cache, each row
starting at its prompt's next rope position), else the generic loop's.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, DynamicCache

from rlctl.errors import UserError, did_you_mean
from rlctl.rollout.base import (
    RolloutEngine,
    Sample,
    SamplingParams,
    check_generate_args,
    default_stop_token_ids,
    torch_dtype,
)
from rlctl.rollout.hf_decode import FastDecoder, TextModel, unsupported_reason
from rlctl.rollout.spec import RolloutSpec

logger = logging.getLogger(__name__)


class HFRolloutEngine(RolloutEngine):
    """Generation with a private copy of the HF model on one device."""

    name = "hf"
    supports_sleep = False

    def __init__(self, spec: RolloutSpec) -> None:
        # mem_fraction does not apply; the n samples of a prompt always share its prefill.
        if spec.tp != 1:
            raise UserError(f"the hf rollout engine runs on one device; use tp=1 (got tp={spec.tp}) or the vllm engine")
        self.device = torch.device(spec.device)
        self.max_model_len = spec.max_model_len
        self.vision = getattr(AutoConfig.from_pretrained(spec.model_path), "vision_config", None) is not None
        auto = AutoModelForImageTextToText if self.vision else AutoModelForCausalLM
        self.model = auto.from_pretrained(spec.model_path, dtype=torch_dtype(spec.dtype))
        self.model.to(self.device).eval().requires_grad_(False)
        self.stop_token_ids = default_stop_token_ids(spec.model_path)
        self.pad_token_id = 0  # any id works: padded positions are masked out
        # a VL model never samples its vision tokens: an image token in a response has no image behind it
        self.banned = vision_token_ids(self.model.config, self.device) if self.vision else None
        self._generator = torch.Generator(self.device).manual_seed(spec.seed)
        # The fast decode step (rlctl.rollout.hf_decode) when the architecture allows; it fuses the
        # projections in place, so it is built before the state dict below is taken.
        self.fast_decode = True  # False: always the generic loop (tests and benchmarks compare both)
        self._fast: FastDecoder | None = None
        self._logged: set[str] = set()
        text = TextModel(self.model) if self.vision else self.model  # a VL model: its text model decodes
        reason = unsupported_reason(text)
        if reason is None:
            self._fast = FastDecoder(text)
        else:
            self._log_fallback(reason)
        # multi-turn sessions (start_session): each sample's keys and values, by the tokens they cover
        self._session = False
        self._kept: dict[tuple[int, ...], torch.Tensor] = {}
        self.prefilled_tokens = 0  # prompt columns computed by the fast path's prefill (tests, benchmarks)
        # state_dict() tensors share storage with the model's parameters: copying into them
        # updates the model (and the fast path's fused weights) in place.
        self._tensors = self.model.state_dict()

    def _log_fallback(self, reason: str) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("hf rollout: generic decoding loop, not the fast decode step: %s", reason)

    def _generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[Sample]:
        return self._decode(prompt_token_ids, n, sampling, [sampling.max_tokens] * (len(prompt_token_ids) * n))

    def _generate_images(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams, images: list
    ) -> list[Sample]:
        if not self.vision:
            raise UserError("prompts with images, but the rollout model has no vision tower")
        budgets = [sampling.max_tokens] * (len(prompt_token_ids) * n)
        return self._decode(prompt_token_ids, n, sampling, budgets, images=images)

    def _vision_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, images: list) -> dict:
        """The prefill's images and multimodal rope positions [3, B, T] (pads masked out)."""
        given = [im for im in images if im is not None]
        pixels = torch.cat([torch.as_tensor(np.asarray(im[0])) for im in given]).to(self.device, self.model.dtype)
        grid = torch.cat([torch.as_tensor(np.asarray(im[1]), dtype=torch.long) for im in given]).to(self.device)
        types = (input_ids == self.model.config.image_token_id).int()
        rope, _ = self.model.model.get_rope_index(
            input_ids, mm_token_type_ids=types, image_grid_thw=grid, attention_mask=attention_mask
        )
        return {"pixel_values": pixels, "image_grid_thw": grid, "position_ids": rope}

    def _continue(self, histories: list[list[int]], sampling: SamplingParams, max_tokens: list[int]) -> list[Sample]:
        return self._decode(histories, 1, sampling, max_tokens)

    def start_session(self) -> None:
        self._session, self._kept = True, {}

    def end_session(self) -> None:
        self._session, self._kept = False, {}

    def _kept_prefix(self, history: list[int]) -> torch.Tensor | None:
        """The kept keys and values of the longest kept prefix of ``history`` (None: nothing kept)."""
        for length in sorted({len(k) for k in self._kept}, reverse=True):
            if length < len(history) and (kv := self._kept.get(tuple(history[:length]))) is not None:
                return kv
        return None

    def _fast_prefill(self, fast: FastDecoder, prompts: list[list[int]], n: int, max_new: int, input_ids):
        """The fast path's state and first logits; in a session, each prompt (a trajectory so far) starts from
        the keys and values kept for its prefix, and only the columns after the shortest kept prefix are
        computed (the appended tool tokens and the last sampled token), not the whole trajectory again."""
        state = fast.start([len(p) for p in prompts], n, max_new, keep_rows=self._session)
        width, cached = input_ids.shape[1], 0
        kept = [self._kept_prefix(p) for p in prompts] if self._session and n == 1 else []
        if kept and all(kv is not None for kv in kept):
            cached = min(width - len(p) + kv.shape[3] for p, kv in zip(prompts, kept))
            for row, (p, kv) in enumerate(zip(prompts, kept)):
                state.load_row_kv(row, width - len(p), kv)
        self.prefilled_tokens += len(prompts) * (width - cached)
        return state, state.prefill(input_ids, cached)

    def _keep(self, state, prompts: list[list[int]], n: int, tokens: list[list[int]]) -> None:
        """After a session's call: each sample's keys and values (its prompt and every token fed back)."""
        width = max(len(p) for p in prompts)
        self._kept = {}
        for s, sampled in enumerate(tokens):
            prompt = prompts[s // n]
            covered = prompt + sampled[:-1]  # the last sampled token was never fed
            start = width - len(prompt)
            self._kept[tuple(covered)] = state.row_kv(s, start, start + len(covered))

    def _vision_fast_prefill(self, fast: FastDecoder, prompts: list[list[int]], n: int, max_new: int, padded, images):
        """VL prompts: the HF model's prefill (images, multimodal rope) once per prompt, its keys and values copied
        into the fast decode state's cache (each prompt's for its ``n`` rows), each row's next position the
        prompt's next rope position. ``padded``: (input_ids, attention_mask) of the left-padded prompts."""
        input_ids, attention_mask = padded
        width = input_ids.shape[1]
        generic, logits = self._generic_prefill(input_ids, attention_mask, 1, images)
        state = fast.start([len(p) for p in prompts], n, max_new)
        for i, layer in enumerate(generic.cache.layers):
            state.prompt_kv[i, 0].copy_(layer.keys[:, None])
            state.prompt_kv[i, 1].copy_(layer.values[:, None])
        state.position = generic.next_position.repeat_interleave(n)
        self.prefilled_tokens += len(prompts) * width
        return state, logits

    def _generic_prefill(self, input_ids, attention_mask, n: int, images: list | None):
        """The HF model's prefill of the padded prompts (with their images): (the decode steps, last logits)."""
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        kwargs = {"position_ids": position_ids}
        if images is not None:
            kwargs = self._vision_inputs(input_ids, attention_mask, images)
            position_ids = kwargs["position_ids"][0]  # the prompts end in text: equal on the three axes there
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        return _HFSteps(self.model, cache, attention_mask, position_ids, n), out.logits[:, -1]

    @torch.inference_mode()
    def _decode(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        sampling: SamplingParams,
        max_tokens: list[int],
        images: list | None = None,
    ) -> list[Sample]:
        """``n`` samples per prompt, sample ``s`` at most ``max_tokens[s]`` tokens (``images``: each prompt's)."""
        check_generate_args(prompt_token_ids, n, self.max_model_len)
        stop_ids = self.stop_token_ids | set(sampling.stop_token_ids or ())
        generator = self._generator
        if sampling.seed is not None:
            generator = torch.Generator(self.device).manual_seed(sampling.seed)

        input_ids, attention_mask = left_pad(prompt_token_ids, self.pad_token_id, self.device)
        num_samples = len(prompt_token_ids) * n
        budget = [min(max_tokens[s], self.max_model_len - len(prompt_token_ids[s // n])) for s in range(num_samples)]
        fast = self._fast if self.fast_decode else None
        if fast is not None and (reason := fast.window_reason(input_ids.shape[1] + max(budget))):
            self._log_fallback(reason)
            fast = None
        # One prefill per prompt; its cache is shared by the prompt's n samples.
        if fast is not None and images is not None:  # the whole model's prefill, then the fast decode steps
            padded = (input_ids, attention_mask)
            steps, logits = self._vision_fast_prefill(fast, prompt_token_ids, n, max(budget), padded, images)
        elif fast is not None:
            # the fast path's own prefill, into its preallocated cache (after kept columns, in a session)
            state, logits = self._fast_prefill(fast, prompt_token_ids, n, max(budget), input_ids)
            steps: _Steps = state
        else:
            steps, logits = self._generic_prefill(input_ids, attention_mask, n, images)
        logits = logits.repeat_interleave(n, dim=0)
        tokens: list[list[int]] = [[] for _ in range(num_samples)]
        logprobs: list[list[float]] = [[] for _ in range(num_samples)]
        finish: list[str | None] = [None] * num_samples
        rows = list(range(num_samples))  # sample index of each row still decoding

        while True:
            next_tokens, next_logprobs = sample_next_token(logits, sampling, generator, self.banned)
            for s, token, logprob in zip(rows, next_tokens.tolist(), next_logprobs.tolist()):
                tokens[s].append(token)
                logprobs[s].append(logprob)
                if token in stop_ids:
                    finish[s] = "stop"
                elif len(tokens[s]) >= budget[s]:
                    finish[s] = "length"
            alive = [i for i, s in enumerate(rows) if finish[s] is None]
            if not alive:
                break
            if len(alive) < len(rows):
                rows = [rows[i] for i in alive]
                keep = torch.tensor(alive, device=self.device)
                steps.drop(keep)
                next_tokens = next_tokens[keep]
            logits = steps.step(next_tokens)

        if fast is not None and self._session:
            self._keep(steps, prompt_token_ids, n, tokens)
        elif self._session:
            self._kept = {}
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


VISION_REASON = "a vision-language model: the prefill runs through the whole model with the images"
VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_token_ids(config, device: torch.device) -> torch.Tensor | None:
    """The vision tokens of a VL model's config (never sampled), or None when it names none."""
    ids = sorted({int(i) for k in VISION_TOKEN_KEYS if (i := getattr(config, k, None)) is not None})
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


class _Steps(Protocol):
    """The decode steps after the prefill: ``drop`` rows that finished, ``step`` one token per row."""

    def drop(self, keep: torch.Tensor) -> None: ...

    def step(self, tokens: torch.Tensor) -> torch.Tensor: ...


class _HFSteps:
    """The generic loop: the HF model's forward with a ``DynamicCache``, finished rows dropped at once."""

    def __init__(self, model, cache: DynamicCache, attention_mask: torch.Tensor, position_ids: torch.Tensor, n: int):
        cache.batch_repeat_interleave(n)
        self.model, self.cache = model, cache
        self.attention_mask = attention_mask.repeat_interleave(n, dim=0)
        self.next_position = position_ids[:, -1].repeat_interleave(n, dim=0) + 1

    def drop(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.attention_mask = self.attention_mask[keep]
        self.next_position = self.next_position[keep]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = self.attention_mask
        self.attention_mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self.attention_mask,
            position_ids=self.next_position[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.next_position = self.next_position + 1
        return out.logits[:, -1]


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
    logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator,
    banned: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits`` (rows, vocab); return (tokens, their log-probs).

    The log-prob is ``log_softmax(logits / temperature)`` at the drawn token, before top-k/top-p
    (``log_softmax(logits)`` when greedy). ``banned`` token ids are never drawn (a filter like top-k: the
    log-probs are still the unfiltered distribution's).
    """
    if logits.dtype != torch.float32:
        logits = logits.float()
    if sampling.greedy:
        logprobs = logits.log_softmax(dim=-1)
        tokens = (logits if banned is None else logits.index_fill(-1, banned, float("-inf"))).argmax(dim=-1)
    else:
        scaled = logits if sampling.temperature == 1 else logits / sampling.temperature
        logprobs = scaled.log_softmax(dim=-1)
        if 0 < sampling.top_k < logits.shape[-1] or sampling.top_p < 1 or banned is not None:
            kept = scaled if banned is None else scaled.index_fill(-1, banned, float("-inf"))
            probs = filter_top_k_top_p(kept, sampling.top_k, sampling.top_p).softmax(dim=-1)
        else:
            probs = logprobs.exp()  # softmax(scaled) up to float rounding
        tokens = draw(probs, generator)
    chosen = logprobs.gather(-1, tokens[:, None]).squeeze(1)
    if not bool(torch.isfinite(chosen).all()):  # NaN/inf logits: a diverged policy, not a token to train on
        raise UserError(
            "the policy's next-token logits are not finite (NaN or inf): training diverged; lower the "
            "learning rate (--lr), keep gradient clipping on (train.grad_clip), or resume from an earlier checkpoint"
        )
    return tokens, chosen


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` (rows, vocab; each row sums to 1 up to rounding), by inverse CDF.

    The distribution of ``torch.multinomial(probs, 1)``, but not its draws for a given seed: one uniform
    number per row instead of one exponential per (row, token) (on CPU, 8 x 512 probabilities: 10 us
    instead of 100 us). The CDF is summed in fp64; a token of probability 0 is never drawn.
    """
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand(len(probs), 1, dtype=cdf.dtype, device=cdf.device, generator=generator) * cdf[:, -1:]
    # the first token whose cumulative probability exceeds u; clamped against u rounding up to the total
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


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
