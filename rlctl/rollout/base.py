"""The rollout interface shared by every generation engine.

A rollout engine turns prompts (token ids) into sampled responses with the log-probability of each
sampled token, and accepts new weights from the trainer between steps.

Log-probability convention (every engine returns the same quantity, the trainer computes it too):

* for each generated token, ``log_softmax(logits / temperature)`` at the sampled token, taken
  *before* top-k / top-p filtering (filtering changes which tokens can be drawn, not the reported
  log-probability);
* greedy decoding is ``temperature == 0``; its log-probabilities are ``log_softmax(logits)``
  (temperature 1);
* one exception: vLLM reports the log-probability it sampled from, which with top-k/top-p on is the
  filtered, renormalised distribution's (``logprobs_filtered``; see :mod:`rlctl.rollout.vllm`).

A response's ``token_ids`` include the stop token when generation stopped on one
(``finish_reason == "stop"``); otherwise it ran out of budget (``"length"``: ``max_tokens``, or the
engine's ``max_model_len``). Stop tokens are the tokenizer's EOS, the generation config's EOS ids
and ``SamplingParams.stop_token_ids``.

Sleep and wake (colocated engines give the accelerator to the trainer between rollouts) are a small
state machine kept by :class:`RolloutEngine` for every engine, whether or not it can really free memory:

* weights: ``resident`` (current, usable) -> ``stale`` (the trainer stepped since the last sync,
  :meth:`~RolloutEngine.trainer_stepped`) -> ``resident`` again after :meth:`~RolloutEngine.update_weights`;
  :meth:`~RolloutEngine.sleep` makes them ``released``;
* KV cache: ``resident`` / ``released``.

Waking is tagged, as vLLM (``wake_up(tags=["weights"])`` then ``["kv_cache"]``) and SGLang
(``resume_memory_occupation(tags)``) define it: :meth:`~RolloutEngine.wake_weights` first, then a sync
when the weights are not current, then :meth:`~RolloutEngine.wake_kv`; :meth:`~RolloutEngine.ready`
does the three. Woken weights are ``resident`` only when the engine keeps them while asleep AND the
trainer has not stepped since the last sync; otherwise they are ``stale`` and must be synced. vLLM
(sleep level 2) and SGLang (no CPU backup) both discard them: the trainer overwrites them after every
step anyway, and a host copy would cost host memory and a device-to-host copy per step.

Before every wake, the process's freed blocks go back to the device (``gc.collect()``, then
``torch.cuda.empty_cache()``): the trainer's allocator keeps what it freed reserved, and vLLM's
allocator and SGLang's scheduler process (another process) can only map memory the driver sees as free. An illegal
transition (generate with stale or released weights or a released KV cache, sync into released
weights, wake the KV cache before the weights) raises :class:`RolloutStateError`, a bug of the caller.
"""

from __future__ import annotations

import gc
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, Self

import torch

from rlctl.errors import UserError, did_you_mean
from rlctl.names import ROLLOUT_ENGINES
from rlctl.rollout.spec import RolloutSpec

# Engine name (rlctl.names.RolloutEngine) -> "module:class"; each class is built from a RolloutSpec
# (tests/config holds the keys equal to the names).
_ENGINE_CLASSES = {
    "hf": "rlctl.rollout.hf:HFRolloutEngine",
    "vllm": "rlctl.rollout.vllm:VLLMRolloutEngine",
    "sglang": "rlctl.rollout.sglang:SGLangRolloutEngine",
}

FinishReason = Literal["stop", "length"]

#: A vision-language prompt's images as its image processor gave them: ``pixel_values`` [patches, D] and
#: ``image_grid_thw`` [images, 3] (numpy arrays or tensors), in the order of the prompt's image tokens (which
#: are already expanded, one per merged patch: rlctl.data.vision). The trainer's forward gets the same.
PromptImages = tuple  # (pixel_values, image_grid_thw)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy; ``top_k == -1`` means no top-k."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise UserError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Sample:
    """One sampled response to prompt number ``prompt_index``."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason


class WeightsState(StrEnum):
    RESIDENT = "resident"  # the trainer's current weights, usable
    STALE = "stale"  # usable memory, but the trainer has stepped (or they were discarded asleep): sync first
    RELEASED = "released"  # asleep: wake_weights() first


class KVState(StrEnum):
    RESIDENT = "resident"
    RELEASED = "released"


class RolloutStateError(RuntimeError):
    """An illegal sleep/wake/sync/generate sequence: a bug in the caller, not the user's input."""


class RolloutEngine(ABC):
    """A generation engine that the trainer drives between optimisation steps.

    Subclasses implement :meth:`_generate`, :meth:`_load_weights` and, when they can free accelerator
    memory (``supports_sleep``), :meth:`_release` / :meth:`_resume`; the public methods keep the state
    machine of the module docstring.
    """

    name: str
    supports_sleep: bool = False  # whether sleep really frees accelerator memory
    keeps_weights_asleep: bool = True  # whether the weights survive a sleep (in host memory)
    logprobs_filtered: bool = False  # with top-k/top-p on, log-probs of the filtered distribution (vLLM)
    weights_state: WeightsState = WeightsState.RESIDENT
    kv_state: KVState = KVState.RESIDENT
    _trainer_stepped: bool = False  # since the last sync

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        n: int,
        sampling: SamplingParams,
        images: list[PromptImages | None] | None = None,
    ) -> list[Sample]:
        """Sample ``n`` responses per prompt.

        Returns ``len(prompt_token_ids) * n`` samples in prompt-major order: the ``n`` samples of
        prompt 0, then those of prompt 1, and so on. Needs resident weights and KV cache. ``images``: a
        vision-language model's images of each prompt (:data:`PromptImages`, None for a prompt without).
        """
        if self.weights_state != WeightsState.RESIDENT or self.kv_state != KVState.RESIDENT:
            raise RolloutStateError(
                f"{self.name} rollout engine: generate with {self.weights_state} weights and a "
                f"{self.kv_state} KV cache; call ready(sync) (wake, sync, wake the KV cache) first"
            )
        if images is not None and any(im is not None for im in images):
            if len(images) != len(prompt_token_ids):
                raise ValueError("generate needs one images entry (or None) per prompt")
            return self._generate_images(prompt_token_ids, n, sampling, images)
        return self._generate(prompt_token_ids, n, sampling)

    def _generate_images(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams, images: list
    ) -> list[Sample]:
        """:meth:`generate` with images; engines that take them override it."""
        raise UserError(f"the {self.name} rollout engine does not take images; use --rollout hf")

    def continue_generation(
        self, histories: list[list[int]], sampling: SamplingParams, max_tokens: list[int]
    ) -> list[Sample]:
        """One more turn after each token history (a multi-turn trajectory so far: its prompt, the tokens
        sampled and the tool / user tokens appended), at most ``max_tokens[i]`` new tokens for history ``i``
        (``sampling.max_tokens`` is ignored). Token ids in, token ids out: nothing is re-tokenized. One sample
        per history, in order (``prompt_index`` = the history's index). Engines with a prefix cache reuse
        the histories' cached prefixes (vLLM's automatic prefix caching, SGLang's radix cache, the hf engine's
        kept KV cache)."""
        if self.weights_state != WeightsState.RESIDENT or self.kv_state != KVState.RESIDENT:
            raise RolloutStateError(
                f"{self.name} rollout engine: continue_generation with {self.weights_state} weights and a "
                f"{self.kv_state} KV cache; call ready(sync) first"
            )
        if len(max_tokens) != len(histories) or min(max_tokens, default=1) < 1:
            raise ValueError("continue_generation needs one max_tokens >= 1 per history")
        return self._continue(histories, sampling, max_tokens)

    def start_session(self) -> None:
        """A multi-turn rollout begins: engines that can keep what they computed for the samples of each call
        (the hf engine: their keys and values) keep it, for :meth:`continue_generation` to start from."""
        return None  # vLLM and SGLang cache prefixes on their own

    def end_session(self) -> None:
        """The multi-turn rollout is over: drop what :meth:`start_session` kept."""
        return None

    def _continue(self, histories: list[list[int]], sampling: SamplingParams, max_tokens: list[int]) -> list[Sample]:
        """:meth:`continue_generation` of the engine; by default one ``_generate`` per distinct budget."""
        from dataclasses import replace

        out: list[Sample | None] = [None] * len(histories)
        for budget in sorted(set(max_tokens)):
            idx = [i for i, m in enumerate(max_tokens) if m == budget]
            seed = None if sampling.seed is None else sampling.seed + budget
            samples = self._generate([histories[i] for i in idx], 1, replace(sampling, max_tokens=budget, seed=seed))
            for i, s in zip(idx, samples, strict=True):
                out[i] = replace(s, prompt_index=i)
        return out  # type: ignore[return-value]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights, named as in the HF CausalLM's ``state_dict()``; they become ``resident``.

        The iterable is consumed one tensor at a time, so the caller can produce tensors lazily
        (e.g. gather one FSDP shard at a time) and memory stays bounded. Not into released weights.
        """
        if self.weights_state == WeightsState.RELEASED:
            raise RolloutStateError(f"{self.name} rollout engine: sync into released weights; wake_weights() first")
        self._load_weights(named_tensors)
        self.weights_state, self._trainer_stepped = WeightsState.RESIDENT, False

    def trainer_stepped(self) -> None:
        """The trainer changed its weights: this engine's are stale until the next :meth:`update_weights`."""
        self._trainer_stepped = True
        if self.weights_state == WeightsState.RESIDENT:
            self.weights_state = WeightsState.STALE

    def sleep(self) -> None:
        """Free the KV cache and the weights for training (no-op on the hardware where unsupported)."""
        if self.weights_state == WeightsState.RELEASED and self.kv_state == KVState.RELEASED:
            return
        if self.supports_sleep:
            self._release(("kv_cache", "weights"))
        self.weights_state, self.kv_state = WeightsState.RELEASED, KVState.RELEASED

    def wake_weights(self) -> None:
        """Bring the weights back: ``resident`` when they were kept asleep and the trainer has not stepped
        since the last sync, else ``stale`` (sync them before generating)."""
        if self.weights_state != WeightsState.RELEASED:
            return
        if self.supports_sleep:
            release_cached_blocks()
            self._resume(("weights",))
        current = self.keeps_weights_asleep or not self.supports_sleep
        self.weights_state = WeightsState.RESIDENT if current and not self._trainer_stepped else WeightsState.STALE

    def wake_kv(self) -> None:
        """Bring the KV cache back (after the weights)."""
        if self.kv_state == KVState.RESIDENT:
            return
        if self.weights_state == WeightsState.RELEASED:
            raise RolloutStateError(f"{self.name} rollout engine: wake the weights before the KV cache")
        if self.supports_sleep:
            release_cached_blocks()
            self._resume(("kv_cache",))
        self.kv_state = KVState.RESIDENT

    def wake(self) -> None:
        """Wake the weights, then the KV cache (no sync: generate raises if the weights are not current)."""
        self.wake_weights()
        self.wake_kv()

    def ready(self, sync: Callable[[], None]) -> bool:
        """Make the engine ready to generate: wake the weights, call ``sync()`` (which must call
        :meth:`update_weights` with the trainer's weights) when they are not current, wake the KV
        cache. Returns whether it synced."""
        self.wake_weights()
        synced = self.weights_state != WeightsState.RESIDENT
        if synced:
            sync()
            if self.weights_state != WeightsState.RESIDENT:
                raise RolloutStateError(f"{self.name} rollout engine: sync() did not load the trainer's weights")
        self.wake_kv()
        return synced

    @abstractmethod
    def _generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[Sample]:
        """:meth:`generate` of the engine, states already checked."""

    @abstractmethod
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`update_weights` of the engine, states already checked."""

    def _release(self, tags: tuple[str, ...]) -> None:
        """Free the memory of ``tags`` ("kv_cache", "weights"); only called when ``supports_sleep``."""
        raise NotImplementedError(f"{self.name} cannot sleep")

    def _resume(self, tags: tuple[str, ...]) -> None:
        """Re-allocate the memory of ``tags``; only called when ``supports_sleep``."""
        raise NotImplementedError(f"{self.name} cannot sleep")

    @abstractmethod
    def close(self) -> None:
        """Release everything the engine holds. Safe to call twice."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_rollout_engine(spec: RolloutSpec) -> RolloutEngine:
    """Build the rollout engine ``spec.engine`` ("hf", "vllm" or "sglang") for the HF model at
    ``spec.model_path``; UserError for a spec no engine can take. The engine gets the spec with its dtype
    spelled as torch spells it (``bf16`` -> ``bfloat16``)."""
    name = spec.engine
    if name not in ROLLOUT_ENGINES:
        raise UserError(
            f"unknown rollout engine {name!r}{did_you_mean(name, ROLLOUT_ENGINES)}; "
            f"choose one of {', '.join(ROLLOUT_ENGINES)}"
        )
    if spec.tp < 1:
        raise UserError(f"rollout tp must be >= 1, got {spec.tp}")
    if not 0 < spec.mem_fraction <= 1:
        raise UserError(f"rollout mem_fraction must be in (0, 1], got {spec.mem_fraction}")
    if spec.max_model_len < 2:
        raise UserError(f"max_model_len must be >= 2, got {spec.max_model_len}")
    module_name, class_name = _ENGINE_CLASSES[name].split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    return engine_class(spec.replace(dtype=canonical_dtype(spec.dtype)))


# Helpers shared by the engines ------------------------------------------------------------------


def release_cached_blocks() -> None:
    """Give the device the memory this process freed: drop unreachable tensors, then the caching
    allocator's free blocks (a no-op without CUDA)."""
    gc.collect()
    torch.cuda.empty_cache()


def canonical_dtype(dtype: str) -> str:
    """'bf16' -> 'bfloat16' and so on; UserError for anything else."""
    if dtype not in _DTYPES:
        raise UserError(f"unknown dtype {dtype!r}{did_you_mean(dtype, _DTYPES)}; use float32, bfloat16 or float16")
    return str(_DTYPES[dtype]).removeprefix("torch.")


def torch_dtype(dtype: str) -> torch.dtype:
    return _DTYPES[canonical_dtype(dtype)]


def default_stop_token_ids(model_path: str) -> set[int]:
    """The tokenizer's EOS id plus the EOS ids of the model's generation config."""
    from transformers import AutoTokenizer, GenerationConfig

    ids: set[int] = set()
    eos = AutoTokenizer.from_pretrained(model_path).eos_token_id
    if eos is not None:
        ids.add(int(eos))
    try:
        generation_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:  # no generation_config.json
        generation_eos = None
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos:
        ids.update(int(i) for i in generation_eos)
    return ids


def check_generate_args(prompt_token_ids: list[list[int]], n: int, max_model_len: int) -> None:
    """UserError for empty prompts, prompts that leave no room to generate, or n < 1."""
    if n < 1:
        raise UserError(f"n (samples per prompt) must be >= 1, got {n}")
    for i, prompt in enumerate(prompt_token_ids):
        if not prompt:
            raise UserError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(prompt) >= max_model_len:
            raise UserError(
                f"prompt {i} has {len(prompt)} tokens, leaving no room to generate within "
                f"max_model_len={max_model_len}; raise max_model_len or shorten the prompt"
            )
