"""What a job is, for its memory estimate: :class:`MemorySettings` and the constants of the model.

No torch import: the CLI estimates in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace

from rlctl import names
from rlctl.catalog.spec import ModelSpec
from rlctl.errors import UserError
from rlctl.support import JobFacts, model_facts, refuse

GIB = 2**30
CUDA_CONTEXT_BYTES = GIB  # CUDA context, cuBLAS workspaces, NCCL buffers: outside torch's allocator
ALLOCATOR_SLACK = 0.25  # reserved = allocated + this x the transient tensors (activations, logits, gathered layers)
ENGINE_GRAPH_BYTES = GIB // 2  # CUDA graphs captured by vLLM / SGLang
ENGINE_BATCHED_TOKENS = 8192  # tokens per SGLang forward (its chunked prefill size on large GPUs)
ENGINE_MAX_SEQS = 256  # sequences per SGLang step: the sampler's logits
ADAM_STATE_BYTES = 8  # AdamW m and v in fp32
LOGIT_EXTRA_BYTES = 8  # unfused loss peak per logit: fp32 log-softmax (saved) + its fp32 gradient, beside
# the logits and their gradient in the compute dtype (2 x compute bytes): 12 bytes per value in bf16. Not on
# Megatron's vocab-parallel path (tp > 1), whose loss runs in row chunks: the VOCAB_PARALLEL_CHUNKS below instead
VOCAB_PARALLEL_CHUNK_VALUES = 1 << 25  # rlctl.algos.vocab_parallel.CHUNK_ELEMENTS (torch-free; tests/estimate pins it)
VOCAB_PARALLEL_CHUNKS = 4  # fp32 chunks alive at its peak: measured 1.5 (log-probs, entropy), 3.5 (the teacher's JSD)
DEFAULT_LABELLED_FRACTION = 1.0  # sft / dpo without data to measure: every position may carry a label (a bound)
CHUNK_LOGIT_BYTES = 12  # per logit of one loss chunk beyond the compute dtype: fp32 upcast, log-softmax, gradient
PRECISIONS = names.choices(names.Precision)  # mixed: fp32 master, grads and AdamW; bf16: pure bf16 state
HOST_PROCESS_BYTES = 4 * GIB  # host memory of one GPU process: Python, torch/CUDA/NCCL host allocations, data
HOST_MARGIN_FRACTION = 0.10  # host memory kept free: the OS, page cache, allocator slack
CHECKPOINT_BYTES = 2  # bytes per parameter of the HF checkpoint (bf16) that FSDP's rank 0 loads whole

METHODS = names.choices(names.Method)
BACKENDS = names.BACKENDS
ENGINES = names.ROLLOUT_ENGINES
DEVICES = names.choices(names.Device)
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def check_keys(what: str, d: object, keys: Iterable[str]) -> dict:
    """``d`` as a dict with exactly ``keys``, else a one-line UserError naming the first odd key."""
    if not isinstance(d, dict):
        raise UserError(f"{what}: expected a JSON object, got {type(d).__name__}")
    keys = list(keys)
    unknown = [k for k in d if k not in keys]
    missing = [k for k in keys if k not in d]
    if unknown or missing:
        problem = f"unknown key {unknown[0]!r}" if unknown else f"missing key {missing[0]!r}"
        raise UserError(f"{what}: {problem}; it was written by another rlctl version: plan it again with this one")
    return d


@dataclass
class MemorySettings:
    """Everything about a job that changes its memory (sizes are per the whole job unless noted)."""

    method: str = "grpo"  # sft | grpo | ppo | dpo | rm
    gpus: int = 1  # devices in total (processes on CPU)
    nodes: int = 1
    device: str = "cuda"  # cuda | cpu (cpu: no CUDA context, engines size the KV cache for the batch)
    dtype: str = "bf16"  # compute dtype: bf16 | fp16 | fp32
    lora_rank: int = 0  # 0 = full fine-tuning
    lora_targets: str = "all-linear"
    prompt_len: int = 512  # RL: longest prompt
    response_len: int = 1024  # RL: longest response
    max_len: int = 2048  # SFT: sequence length
    micro_batch: int = 1  # sequences per GPU per forward
    rollout_n: int = 8  # samples per prompt
    rollout_batch: int = 32  # prompts per step (sizes the HF engine's batch and the KV target)
    mini_batch_prompts: int = 0  # RL: prompts per optimizer step (algo.mini_batch_size; 0: rollout_batch)
    activation_checkpointing: bool = True
    offload_params: bool = False
    offload_optimizer: bool = False
    host_memory_bytes: int = 0  # host memory of one node for the job; 0 = the GPU type's node, shared by the GPUs used
    backend: str = "fsdp"  # fsdp | megatron
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False  # Megatron's, with tp > 1
    sp: int = 1  # FSDP: Ulysses sequence parallelism, each sequence split over sp GPUs
    rollout: str | None = "vllm"  # hf | vllm | sglang (ignored for sft)
    rollout_tp: int = 1
    rollout_procs: int = 0  # split runs (rollout.procs): devices that only generate; ``gpus`` only train
    mem_fraction: float = 0.5  # vLLM gpu_memory_utilization / SGLang mem_fraction_static
    kl: bool = True  # a reference model is kept beside the policy (RL with a KL term; dpo's per-step reference)
    critic: bool | None = None  # None = PPO has one
    optimizer: str = "adamw"
    precision: str = "mixed"  # mixed | bf16 (pure bf16 weights, gradients and AdamW states: 8 bytes/param)
    selective_checkpointing: bool = False  # recompute the MLPs only (their inputs kept), attention kept
    offload_activations: bool = False  # saved activations in pinned host memory (save_on_cpu)
    shard: bool = True  # FSDP2 wrappers; False on one GPU: a plain module, no gather buffers
    micro_batch_tokens: int = 0  # token budget of a packed micro batch (0 = micro_batch x seq_len)
    loss_chunk: int = 0  # tokens per chunk of the loss (0 = one unfused loss over the micro batch)
    # sft / dpo: the share of a micro batch's positions that carry a label (the LM head runs there only),
    # measured on the data's first rows (rlctl.data.labelled); None: DEFAULT_LABELLED_FRACTION
    labelled_fraction: float | None = None
    reward_model: bool = False  # PPO/GRPO: a frozen reward model on the training GPUs
    reward_model_dtype: str = "fp32"  # reward.model_dtype: every rank holds a whole replica in it
    teacher_params: int = 0  # on-policy distillation: the frozen teacher's parameters, held like the reference
    teacher_logits: bool = False  # algo.distill=full: the teacher's logits (teacher_logits_bytes)
    distill_beta: float = 1.0  # algo.distill_beta: the divergence (1 reverse KL, 0 forward KL, between: JSD)
    # vision-language models (text models ignore these)
    images: int = 1  # images per sample (in the prompt)
    image_pixels: int = 0  # pixels of each image after the processor (0 = its max_pixels: the most an image costs)
    train_vision: bool = False  # train the vision tower too (default: frozen: no gradients, no AdamW states)
    image_tokens: int = 0  # derived (with_images): merged image tokens per sample, added to the sequence
    image_patches: int = 0  # derived (with_images): patch rows per sample through the vision tower

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MemorySettings:
        """The inverse of :meth:`to_dict`; an unknown or missing key is a UserError."""
        return cls(**check_keys("memory settings", d, [f.name for f in fields(cls)]))

    @property
    def is_rl(self) -> bool:
        return self.method in names.RL_METHODS

    @property
    def seqs_per_unit(self) -> int:
        """Sequences a micro batch holds per unit it counts: a preference pair's two (dpo, rm), else one."""
        return 2 if self.method in names.PAIR_METHODS else 1

    @property
    def keeps_reference(self) -> bool:
        """A frozen reference model beside the trained one: RL with a KL term or dpo's per-step reference
        (``kl``); with LoRA the base with adapters off is the reference, no copy."""
        return self.kl and (self.is_rl or self.method == "dpo") and not self.lora_rank

    @property
    def teacher_bytes(self) -> int:
        """The distillation teacher's weights on one GPU (or, offloaded, in host memory per process): a frozen
        engine built like the reference, in the compute dtype, sharded like the policy (any LoRA)."""
        if not self.is_rl or not self.teacher_params:
            return 0
        return math.ceil(
            self.compute_bytes
            * self.teacher_params
            / (self.fsdp_shards if self.backend == "fsdp" else self.tp * self.pp)
        )

    @property
    def vocab_parallel(self) -> bool:
        """The loss reads each GPU's ``1 / tp`` of the vocabulary, never gathered, in row chunks (Megatron's TP:
        rlctl.algos.vocab_parallel)."""
        return self.backend == "megatron" and self.tp > 1

    @property
    def keeps_labelled(self) -> bool:
        """The engine runs the LM head at the labelled positions only (sft, dpo on FSDP: ``keep_cols``);
        Megatron's output layer runs at every position of its rows."""
        return self.method in ("sft", "dpo") and self.backend == "fsdp"

    @property
    def labelled_share(self) -> float:
        """:attr:`labelled_fraction`, or the stated default where the data was not measured."""
        return DEFAULT_LABELLED_FRACTION if self.labelled_fraction is None else self.labelled_fraction

    @property
    def scalar_head(self) -> bool:
        """The trained model ends in a scalar head instead of the output head (rm): no logits."""
        return self.method == "rm"

    @property
    def has_critic(self) -> bool:
        return self.method == "ppo" if self.critic is None else self.critic

    @property
    def seq_len(self) -> int:
        """Tokens of one training sequence (a VL model's image tokens added to the text)."""
        return (self.prompt_len + self.response_len if self.is_rl else self.max_len) + self.image_tokens

    @property
    def prompt_tokens(self) -> int:
        """Tokens of one prompt as the rollout engine prefills it (image tokens included)."""
        return self.prompt_len + self.image_tokens

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one GPU computes per forward: its share of the sequence under context or Ulysses
        sequence parallelism."""
        tokens = self.micro_batch_tokens or self.micro_batch * self.seq_len * self.seqs_per_unit
        return tokens // (self.cp * self.sp)

    @property
    def pure_bf16(self) -> bool:
        return self.precision == "bf16"

    @property
    def sharded(self) -> bool:
        """FSDP wraps the model (always over several GPUs; on one GPU unless ``shard`` is off)."""
        return self.backend == "fsdp" and (self.shard or self.gpus > 1)

    @property
    def cpu_offload(self) -> bool:
        """FSDP2 CPU offload: sharded weights, gradients and optimizer states live on the CPU."""
        return self.device == "cuda" and self.backend == "fsdp" and (self.offload_params or self.offload_optimizer)

    @property
    def megatron_optimizer_offload(self) -> bool:
        """megatron-core's ``optimizer_cpu_offload``: fp32 master, gradient copy and AdamW states on the CPU."""
        return self.device == "cuda" and self.backend == "megatron" and self.offload_optimizer

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def idle_weights_offloaded(self) -> bool:
        """Weights (trainer, reference, critic) are off the GPU while their model is idle."""
        return self.cpu_offload or (self.backend == "megatron" and self.offload_params)

    @property
    def idle_optimizer_offloaded(self) -> bool:
        return self.cpu_offload or (self.backend == "megatron" and self.offload_optimizer)

    @property
    def compute_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def dp(self) -> int:
        """Data-parallel ranks: groups that see different sequences."""
        return self.gpus // (self.tp * self.pp * self.cp * self.sp)

    @property
    def fsdp_shards(self) -> int:
        """Ranks FSDP2 shards the model states over: every GPU (dp x sp), as the engine's mesh does."""
        return self.gpus

    def check(self, spec: ModelSpec) -> None:
        """Reject impossible settings with a one-line UserError (what runs with what: :mod:`rlctl.support`)."""
        choices = {"method": METHODS, "backend": BACKENDS, "dtype": tuple(DTYPE_BYTES), "device": DEVICES}
        choices |= {"reward_model_dtype": tuple(DTYPE_BYTES), **({"rollout": ENGINES} if self.is_rl else {})}
        for key, allowed in {**choices, "precision": PRECISIONS}.items():
            if getattr(self, key) not in allowed:
                raise UserError(f"{key}={getattr(self, key)!r} is not one of {', '.join(allowed)}")
        refuse(self.facts(spec), "pure_bf16_dtype", "no_shard_one_gpu")
        if self.backend == "megatron" and (
            self.pure_bf16 or self.offload_activations or self.selective_checkpointing or not self.shard
        ):
            raise UserError(
                "the megatron engine has no pure-bf16, selective-checkpointing, activation-offload or no-shard "
                "option in rlctl: use --backend fsdp for them"
            )
        refuse(JobFacts(backend=self.backend, vision=spec.is_vl), "megatron_forced")  # what it knows: the model
        self._check_ranges()
        if self.gpus % (self.tp * self.pp * self.cp):
            raise UserError(f"{self.gpus} GPUs do not split into tp {self.tp} x pp {self.pp} x cp {self.cp}")
        refuse(self.facts(spec), "fsdp_layout", "sp_backend", "sp_vision", "sp_size")
        self._check_layout(spec)

    def _check_ranges(self) -> None:
        if self.images < 0 or self.image_pixels < 0:
            raise UserError("images and image_pixels must be positive (image_pixels 0 = the processor's max_pixels)")
        if self.labelled_fraction is not None and not 0 < self.labelled_fraction <= 1:
            raise UserError(f"labelled_fraction must be in (0, 1], got {self.labelled_fraction}")
        if self.micro_batch_tokens < 0 or self.loss_chunk < 0:
            raise UserError("micro_batch_tokens and loss_chunk must be positive (0 = off)")
        if self.optimizer != "adamw":
            raise UserError(f"optimizer={self.optimizer!r}: the estimator models AdamW only")
        for key in ("gpus", "nodes", "micro_batch", "tp", "pp", "cp", "ep", "sp", "rollout_tp", "rollout_n"):
            if getattr(self, key) < 1:
                raise UserError(f"{key} must be at least 1, got {getattr(self, key)}")
        if self.rollout_batch < 1:
            raise UserError(f"rollout_batch must be at least 1, got {self.rollout_batch}")
        if self.gpus % self.nodes:
            raise UserError(f"{self.gpus} GPUs do not split evenly over {self.nodes} nodes")
        if self.host_memory_bytes < 0:
            raise UserError(
                f"host_memory_bytes must be positive (0 = the GPU type's typical node), got {self.host_memory_bytes}"
            )

    def _check_layout(self, spec: ModelSpec) -> None:
        refuse(self.facts(spec), "megatron_pp", "megatron_grid", "megatron_ep")
        if self.is_rl:
            refuse(JobFacts(world=self.gpus, rollout_tp=self.rollout_tp), "rollout_tp_world")
        if self.is_rl and self.rollout != "hf" and self.device == "cuda" and not 0 < self.mem_fraction < 1:
            raise UserError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")

    def facts(self, spec: ModelSpec) -> JobFacts:
        """These settings as the rules of :mod:`rlctl.support` see them (``gpus``: the trainers)."""
        return JobFacts(
            **dict(method=self.method, world=self.gpus, nodes=self.nodes, backend=self.backend, dtype=self.dtype),
            **dict(precision=self.precision, shard=self.shard, sp=self.sp, tp=self.tp, pp=self.pp, ep=self.ep),
            **dict(cp=self.cp, **model_facts(spec)),
        )


def with_images(spec: ModelSpec, s: MemorySettings) -> MemorySettings:
    """``s`` with the image tokens and patches of ``spec`` filled in (zero for a text model): ``images`` per
    sample at ``image_pixels`` (or the processor's max_pixels), patches of the vision tower, merged into tokens."""
    v = spec.vision
    if v is None:
        return replace(s, image_tokens=0, image_patches=0)
    pixels = s.image_pixels or v.max_pixels
    return replace(s, image_tokens=s.images * v.image_tokens(pixels), image_patches=s.images * v.patches(pixels))
