"""In-process SGLang rollout (``sglang.Engine``).

NOT RUN HERE: SGLang cannot be installed on the machines this was written on. The adapter's own
logic (sampling parameters, the n expansion, turning SGLang's outputs into samples, chunked weight
updates) lives in small functions that the tests drive through a fake of the ``sglang.Engine``
boundary; the calls into SGLang follow its documented offline-engine API:

* ``Engine.generate(input_ids=..., sampling_params=..., return_logprob=True)`` returns one dict
  per request with ``meta_info["output_token_logprobs"]`` (``(logprob, token_id, text)`` per
  generated token, the stop token included) and ``meta_info["finish_reason"]["type"]``;
* ``Engine.update_weights_from_tensor(named_tensors, flush_cache=...)`` and ``Engine.flush_cache()``
  (which does nothing while a request is queued or running and answers ``success=False``: the adapter
  raises then, ``Scheduler.flush_cache``);
  from 0.5.23 the updates must run inside a session, ``begin_weight_update()`` ...
  ``end_weight_update()`` (the scheduler refuses them otherwise,
  ``managers/scheduler_components/weight_updater.py``); 0.5.20 has no such methods. The adapter opens a
  session whenever the engine has them;
* ``Engine.release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)`` with the tags
  "kv_cache" and "weights" (needs ``enable_memory_saver=True``). Without SGLang's
  ``enable_weights_cpu_backup`` the released weights are DISCARDED, so ``keeps_weights_asleep`` is
  False: after a sleep the weights wake ``stale`` and :meth:`RolloutEngine.ready` syncs them before
  the next generate (see :mod:`rlctl.rollout.base`).

``mem_fraction`` is rlctl's share of the GPU's whole memory (as vLLM's ``gpu_memory_utilization``), but
SGLang's ``mem_fraction_static`` is a share of the memory free when its scheduler starts (0.5.23:
``mem_cache/kv_cache_configurator.py``, ``_profile_available_bytes``: the KV budget is the free memory
less ``free_before_load x (1 - mem_fraction_static)``). Colocated, the trainer already holds its
weights then, so the adapter converts: ``mem_fraction_static = mem_fraction x total / free``.

Seeds: SGLang reads a request's ``sampling_seed`` only under ``--enable-deterministic-inference``
(``sampling/sampling_batch_info.py``), which rlctl does not turn on (it restricts the attention
backends and costs throughput): SGLang rollouts are not reproducible from the seed, and no seed is sent.

Images (vision-language models; UNTESTED, written from SGLang's "Query VLM with Offline Engine" guide,
``docs/advanced_features/vlm_query``): a prompt's images go as the processor's output,
``image_data=[[{"format": "processor_output", "input_ids", "pixel_values", "image_grid_thw"}]]`` (one list per
request), with ``input_ids`` already expanded (one image token per merged patch, as rlctl.data.rl builds them):
SGLang then uses the same pixels as the trainer instead of processing the pictures again. The engine needs the
model's processor for that, so it is started with its tokenizer (``skip_tokenizer_init`` off) for a VL model.
Each prompt is sent once with ``sampling_params["n"]`` (SGLang's parallel sampling expands it prompt-major after
processing the images once), its pixels in the engine's dtype.

Log-probabilities: SGLang's default returned log-probs are taken after temperature and before
top-k/top-p, and greedy requests run at temperature 1 with top-k 1, which is our convention, as
far as we read its sampler (unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set: leave it unset).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from rlctl.errors import UserError
from rlctl.rollout.base import (
    KVState,
    RolloutEngine,
    Sample,
    SamplingParams,
    check_generate_args,
    default_stop_token_ids,
    release_cached_blocks,
    torch_dtype,
)
from rlctl.rollout.spec import RolloutSpec

# Weight updates are sent in chunks of at most this many bytes (one tensor may exceed it alone).
WEIGHT_CHUNK_BYTES = 512 << 20


def _import_engine_class() -> type:
    try:
        import sglang
    except ImportError as error:
        raise UserError(
            "the sglang rollout engine needs SGLang, which is not installed: pip install 'rlctl[sglang]'"
        ) from error
    return sglang.Engine


class SGLangRolloutEngine(RolloutEngine):
    """SGLang's offline engine in this process (it runs its scheduler in child processes)."""

    name = "sglang"
    keeps_weights_asleep = False  # release_memory_occupation drops the weights (no CPU backup)

    def __init__(self, spec: RolloutSpec) -> None:
        engine_class = _import_engine_class()
        device_type = torch.device(spec.device).type
        colocated = torch.distributed.is_initialized()
        if colocated and spec.tp != 1:
            raise UserError(
                f"the sglang rollout engine runs one engine per torchrun rank, so tp must be 1 (got {spec.tp}); "
                f"use the vllm engine for tp > 1"
            )
        self.supports_sleep = device_type == "cuda"
        self.max_model_len = spec.max_model_len
        self.stop_token_ids = default_stop_token_ids(spec.model_path)
        self.pixel_dtype = torch_dtype(spec.dtype)  # images travel in the engine's dtype (its tower casts to it)
        mem_fraction = spec.mem_fraction
        if self.supports_sleep:
            # what the driver sees free: the trainer's allocator first gives back the blocks it only caches
            release_cached_blocks()
            mem_fraction = static_fraction(mem_fraction, *torch.cuda.mem_get_info(torch.device(spec.device)))
        self._engine = engine_class(
            model_path=spec.model_path,
            skip_tokenizer_init=not is_vision_model(spec.model_path),  # a VL model's processor needs it
            device=device_type,
            # under torchrun, each rank's engine sits on that rank's GPU
            base_gpu_id=int(os.environ.get("LOCAL_RANK", "0")) if colocated else 0,
            dtype=spec.dtype,
            tp_size=spec.tp,
            mem_fraction_static=mem_fraction,
            context_length=spec.max_model_len,
            random_seed=spec.seed,
            disable_radix_cache=not spec.enable_prefix_caching,
            enable_memory_saver=self.supports_sleep,
        )

    def _generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[Sample]:
        check_generate_args(prompt_token_ids, n, self.max_model_len)
        stop_ids = sorted(self.stop_token_ids | set(sampling.stop_token_ids or ()))
        # We expand each prompt n times ourselves (prompt-major); the radix cache shares the
        # prefill of identical prompts.
        input_ids = [prompt for prompt in prompt_token_ids for _ in range(n)]
        outputs = self._engine.generate(
            input_ids=input_ids,
            sampling_params=sglang_sampling_params(sampling, stop_ids),
            return_logprob=True,
        )
        return samples_from_outputs(outputs, n)

    def _generate_images(
        self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams, images: list
    ) -> list[Sample]:
        check_generate_args(prompt_token_ids, n, self.max_model_len)
        stop_ids = sorted(self.stop_token_ids | set(sampling.stop_token_ids or ()))
        # each prompt once with SGLang's parallel sampling (n): its pixels travel and are processed once, its
        # prefix (images included) is cached before the n samples (tokenizer_manager._handle_batch_request)
        request = image_request(prompt_token_ids, images, self.pixel_dtype)
        params = {**sglang_sampling_params(sampling, stop_ids), "n": n}
        outputs = self._engine.generate(**request, sampling_params=params, return_logprob=True)
        return samples_from_outputs(outputs, n)

    def _continue(self, histories: list[list[int]], sampling: SamplingParams, max_tokens: list[int]) -> list[Sample]:
        # token ids in (input_ids, never text); the radix cache reuses each history's cached prefix
        check_generate_args(histories, 1, self.max_model_len)
        stop_ids = sorted(self.stop_token_ids | set(sampling.stop_token_ids or ()))
        params = sglang_sampling_params(sampling, stop_ids)
        per_request = [{**params, "max_new_tokens": m} for m in max_tokens]  # each history its own budget
        outputs = self._engine.generate(input_ids=histories, sampling_params=per_request, return_logprob=True)
        return samples_from_outputs(outputs, 1)

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        session = callable(getattr(self._engine, "begin_weight_update", None))  # SGLang >= 0.5.23
        if session:
            _raise_unless_ok(self._engine.begin_weight_update())
        try:
            for chunk in chunk_named_tensors(named_tensors, WEIGHT_CHUNK_BYTES):
                _raise_unless_ok(self._engine.update_weights_from_tensor(named_tensors=chunk, flush_cache=False))
        finally:
            if session:
                _raise_unless_ok(self._engine.end_weight_update())
        if self.kv_state == KVState.RESIDENT:  # (a released KV cache holds nothing; waking it flushes)
            _raise_unless_flushed(self._engine.flush_cache())

    def _release(self, tags: tuple[str, ...]) -> None:
        self._engine.release_memory_occupation(tags=list(tags))

    def _resume(self, tags: tuple[str, ...]) -> None:
        self._engine.resume_memory_occupation(tags=list(tags))
        if "kv_cache" in tags:  # nothing cached from before the sleep (or the last sync) may be reused
            _raise_unless_flushed(self._engine.flush_cache())

    def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def is_vision_model(model_path: str) -> bool:
    """Whether the model directory's config.json has a vision tower (a missing file: no)."""
    import json
    from pathlib import Path

    config = Path(model_path) / "config.json"
    try:
        return isinstance(json.loads(config.read_text()).get("vision_config"), dict)
    except (OSError, ValueError):
        return False


def image_request(prompt_token_ids: list[list[int]], images: list, pixel_dtype: torch.dtype) -> dict[str, Any]:
    """``generate``'s ``input_ids`` and ``image_data`` for prompts with images: each prompt once, its images
    as one processor output (None for a prompt without images), the pixels in ``pixel_dtype`` (the vision
    tower's: SGLang casts them to it, as the trainer's mixed precision does; fp32 would double the bytes)."""
    image_data = []
    for prompt, im in zip(prompt_token_ids, images, strict=True):
        item = None
        if im is not None:
            item = [
                {
                    "format": "processor_output",
                    "input_ids": torch.tensor([prompt]),
                    "pixel_values": torch.as_tensor(np.asarray(im[0])).to(pixel_dtype),
                    "image_grid_thw": torch.as_tensor(np.asarray(im[1]), dtype=torch.long),
                }
            ]
        image_data.append(item)
    return {"input_ids": list(prompt_token_ids), "image_data": image_data}


def static_fraction(mem_fraction: float, free_bytes: int, total_bytes: int) -> float:
    """SGLang's ``mem_fraction_static`` (a share of the free memory) for rlctl's ``mem_fraction`` (a share
    of the whole GPU); UserError when the GPU has not that much free."""
    fraction = mem_fraction * total_bytes / max(free_bytes, 1)
    if fraction > 0.95:
        raise UserError(
            f"the sglang rollout engine needs {mem_fraction * total_bytes / 2**30:.1f} GiB "
            f"(rollout.mem_fraction={mem_fraction}) but only {free_bytes / 2**30:.1f} GiB of the GPU are free "
            f"next to the trainer; lower rollout.mem_fraction or offload the trainer (parallel.offload_params)"
        )
    return round(fraction, 4)


def sglang_sampling_params(sampling: SamplingParams, stop_token_ids: list[int]) -> dict[str, Any]:
    """SGLang sampling parameters, one dict for every request (no ``sampling_seed``: see the module docstring)."""
    params = {
        "temperature": sampling.temperature,  # SGLang treats 0 as greedy
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,  # -1 disables top-k in SGLang too
        "max_new_tokens": sampling.max_tokens,
        "stop_token_ids": stop_token_ids,
    }
    return params


def samples_from_outputs(outputs: list[dict[str, Any]], n: int) -> list[Sample]:
    """Turn SGLang's per-request outputs (prompt-major, n per prompt) into samples."""
    samples = []
    for k, output in enumerate(outputs):
        meta = output["meta_info"]
        finish = (meta.get("finish_reason") or {}).get("type")
        if finish not in ("stop", "length"):
            raise RuntimeError(f"SGLang finished request {k} with {meta.get('finish_reason')!r}")
        entries = meta["output_token_logprobs"]
        samples.append(
            Sample(
                prompt_index=k // n,
                token_ids=[int(token) for _, token, *_ in entries],
                logprobs=[float(logprob) for logprob, *_ in entries],
                finish_reason=finish,
            )
        )
    return samples


def chunk_named_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into lists of at most ``max_bytes`` (a larger tensor travels alone), pulling
    from the iterable only as each chunk is needed."""
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


def _raise_unless_ok(result: Any) -> None:
    """SGLang answers weight updates with (success, message)."""
    if isinstance(result, tuple) and result and result[0] is False:
        raise RuntimeError(f"SGLang rejected the weight update: {result[1] if len(result) > 1 else ''}")


def _raise_unless_flushed(result: Any) -> None:
    """SGLang's ``flush_cache`` does nothing while a request is queued or running and answers
    ``FlushCacheReqOutput(success=False)`` (``Scheduler.flush_cache``: "Cache not flushed because there are
    pending requests"); the radix cache would then serve keys and values of the old weights."""
    ok = result.success if hasattr(result, "success") else result is not False
    if not ok:
        raise RuntimeError(f"SGLang kept its radix cache after a weight update: {getattr(result, 'message', '')}")
