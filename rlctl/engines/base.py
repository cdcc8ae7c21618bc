"""The small training-engine interface the recipes use, and where a model's files come from.

An engine owns one model (actor, reference or critic) split over the ranks, its optimizer and its
learning-rate schedule. The recipes (sft, grpo, ppo) only talk to this interface, and
:func:`rlctl.engines.build_engine` picks the engine from the spec's ``backend``
(:class:`rlctl.engines.spec.EngineSpec`, the engine's only input besides its role): the FSDP2 engine
(:mod:`rlctl.engines.fsdp`) or the Megatron engine (:mod:`rlctl.engines.megatron`). What every engine
does first (check the role, take the device, read the model's config) is :meth:`TrainEngine._setup`.

Contract of a training step, for every engine::

    results = engine.forward_backward(micro_batches, loss_fn)   # the same count on every rank
    grad_norm = engine.step()                                    # clip, optimizer step, lr schedule, zero grads

``loss_fn(output, mb) -> (loss, result)`` gets the model's output for one micro-batch (logits
``[B, T, V]``, or values ``[B, T]`` for a critic; under sequence parallelism an actor's output is
:class:`~rlctl.engines.ulysses.ShardedLogits`, under Megatron's tensor parallelism
:class:`VocabParallelLogits`: read them through :func:`response_tokens`, :func:`position_tokens` (sp) or
:func:`full_logits`) and returns this rank's share of the global loss
(the ranks' shares SUM to the global loss) and anything the caller wants back (a tensor or a dict of
tensors), which ``forward_backward`` returns detached, one per micro-batch, on every rank.
``forward_only=True`` runs the same without gradients (``loss`` may be None).

Gradients are summed over data-parallel ranks (not averaged), so a loss normalised by the global
number of loss tokens gives the same update for any world size or number of micro-batches.

Data-parallel coordinates: the ranks that split one copy of the model (Megatron's tensor and
pipeline ranks; :attr:`TrainEngine.mp_size` of them) must be fed the same micro-batches. Data is
dealt by :attr:`~TrainEngine.dp_rank` over :attr:`~TrainEngine.dp_size` replicas, and sums over the
data (metrics, token counts) are reduced over :attr:`~TrainEngine.dp_group`: summing over every rank
would count each value ``mp_size`` times. For FSDP every rank is its own replica (dp = world).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from rlctl.engines.schedule import lr_factor
from rlctl.engines.spec import EngineSpec
from rlctl.errors import UserError

ROLES = ("actor", "ref", "critic")


class TrainEngine(abc.ABC):
    """A (possibly sharded) model with its optimizer; see the module docstring for the step contract.

    The defaults here are what FSDP does (every rank a data-parallel replica, steps as a loop of
    :meth:`forward` / :meth:`backward`, checkpoints with torch.distributed.checkpoint); the Megatron
    engine overrides them.
    """

    backend: str  # "fsdp" | "megatron": recorded in checkpoints, which only the same backend loads
    spec: EngineSpec
    role: str
    trainable: bool
    total_steps: int  # optimizer steps of the run (the lr schedule's length)
    peak_lr: float
    global_step: int  # optimizer steps taken
    model: torch.nn.Module
    device: torch.device
    compute_dtype: torch.dtype  # the dtype of the forward and backward
    source: ModelSource
    hf_config: object  # the transformers config of the underlying model
    # export_hf's names: HF name -> the exported name, or None to leave the tensor out (rlctl rm: the critic's
    # value head as a sequence-classification model's ``score``); None: every tensor under its own name
    export_names: Callable[[str], str | None] | None = None

    def _setup(self, spec: EngineSpec, *, role: str, trainable: bool, total_steps: int, source: ModelSource | None):
        """What every engine does first: check the role, keep the spec, take the device, read the model's config."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if spec.compile:
            raise UserError(f"train.compile is not supported by the {self.backend} engine yet; set train.compile=false")
        self.spec, self.role, self.trainable, self.total_steps = spec, role, trainable, total_steps
        self.peak_lr = spec.optimizer.lr
        self.global_step = 0
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
        )
        self.source = source or model_source(spec.model, random_init=spec.random_init)
        self.hf_config = self.source.load_config()

    @abc.abstractmethod
    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, T, V] (actor/ref) or values [B, T] (critic). Packed rows: attention_mask None."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, *, sync: bool = True) -> None:
        """Accumulate gradients of this rank's share of the loss; ``sync`` on the last micro-batch."""

    def forward_backward(
        self, micro_batches: Sequence[Any], loss_fn: LossFn, *, forward_only: bool = False
    ) -> list[Any]:
        """Run every micro-batch of a step (collective: the same count on every rank of the group).

        A micro-batch has ``input_ids`` and ``position_ids`` [B, T] (and maybe ``attention_mask``).
        ``loss_fn(output, mb) -> (loss, result)``: ``loss`` (this rank's share of the global loss) is
        back-propagated unless ``forward_only``; the detached ``result`` of every micro-batch is
        returned. Training leaves the gradients reduced, ready for :meth:`step`.
        """
        results = []
        with torch.set_grad_enabled(not forward_only):
            for i, mb in enumerate(micro_batches):
                output = self.forward_micro(mb)
                loss, result = loss_fn(output, mb)
                if not forward_only:
                    self.backward(loss, sync=i == len(micro_batches) - 1)
                results.append(detached(result))
        return results

    def forward_micro(self, mb: Any) -> torch.Tensor:
        """The model's output for one micro-batch. An engine may compute the logits only at the positions
        that predict response tokens (``mb.logit_index``; the loss reads them with ``mb.at_response``) and
        run shared-prefix micro-batches (``mb.keep_cols``, ``mb.blocks``) when :attr:`shares_prefix`."""
        return self.forward(mb.input_ids, mb.position_ids, mb.attention_mask)

    def vocab_shard(self, vocab_size: int) -> VocabShard | None:
        """Where this engine splits its logits over the vocabulary (Megatron's tensor parallelism): this rank's
        columns of a ``vocab_size`` vocabulary read alongside its own (a student's, for a teacher). None where
        every rank computes the whole vocabulary (FSDP, tp 1)."""
        return None

    def forward_vocab_shard(self, mb: Any) -> torch.Tensor:
        """One micro-batch's logits ``[B, T, width]`` at this rank's :meth:`vocab_shard` only (never gathered)."""
        raise NotImplementedError(f"the {self.backend} engine does not split its logits over the vocabulary")

    @property
    def shares_prefix(self) -> bool:
        """Whether :meth:`forward_micro` runs shared-prefix micro-batches (prompt once per group)."""
        return False

    @abc.abstractmethod
    def step(self) -> float:
        """Clip gradients, step the optimizer and the schedule, zero gradients; return the total grad norm."""

    def _lr_factor(self, step: int) -> float:
        o = self.spec.optimizer
        return lr_factor(step, max(1, self.total_steps), o.warmup_ratio, o.min_lr_ratio)

    @property
    def lr(self) -> float:
        """The learning rate the next :meth:`step` uses."""
        return self.peak_lr * self._lr_factor(self.global_step)

    def train(self, mode: bool = True) -> None:
        """Switch dropout etc. on (train) or off (eval); a frozen model stays in eval mode."""
        self.model.train(mode and self.trainable)

    # ------------------------------------------------------------------ data-parallel coordinates

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica: which share of the data it takes."""
        return dist.get_rank()

    @property
    def dp_size(self) -> int:
        """How many data-parallel replicas share the data."""
        return dist.get_world_size()

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The group to reduce sums over the data in (None: the default group, every rank)."""
        return None

    @property
    def mp_size(self) -> int:
        """Ranks that split one copy of the model between them and see the same data (Megatron: tp x pp)."""
        return 1

    @property
    def mp_group(self) -> dist.ProcessGroup | None:
        """The group of those ranks (only meaningful when :attr:`mp_size` > 1)."""
        return None

    # ------------------------------------------------------------------ checkpoints

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """A distributed-checkpoint state: {"model", "optim", "scheduler"} (only "model" when frozen)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (after ``dcp.load`` filled it in)."""

    def save_checkpoint(self, path: str | Path) -> None:
        """Write model (+ optimizer, schedule) into the directory ``path`` (collective)."""
        dcp.save(self.state_dict(), checkpoint_id=str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Load what :meth:`save_checkpoint` wrote, resharding to this world size (collective)."""
        state = self.state_dict()
        dcp.load(state, checkpoint_id=str(path))
        self.load_state_dict(state)

    # ------------------------------------------------------------------ full weights

    @abc.abstractmethod
    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, full tensor) one at a time on EVERY rank (collective; LoRA merged)."""

    def export_hf(self, out_dir: str | Path, meta_dir: str | Path, *, dtype: torch.dtype | None = None) -> Path:
        """Write the full (LoRA-merged) model as a Hugging Face directory through the shared hf_writer
        (collective: every rank takes part in every gather; rank 0 writes)."""
        from rlctl.formats.hf_writer import save_hf_model

        rename = self.export_names or (lambda name: name)
        stream = ((rename(name), t.cpu()) for name, t in self.iter_full_params() if rename(name) is not None)
        try:
            if dist.get_rank() == 0:
                save_hf_model(out_dir, stream, meta_dir=meta_dir, dtype=dtype, force=True)
        finally:
            for _ in stream:  # the other ranks (and rank 0 after an error) still join every gather
                pass
        dist.barrier()
        return Path(out_dir)

    def lora_info(self) -> dict | None:
        """The LoRA settings (peft's adapter config as a dict), or None for full fine-tuning."""
        return None

    def save_lora_config(self, out_dir: str | Path) -> None:
        """Write peft's adapter_config.json into ``out_dir`` (LoRA only; nothing to write otherwise)."""
        return None


def response_tokens(output, mb, fn: Callable) -> tuple[torch.Tensor | None, ...]:
    """``fn(logits [N, V], labels [N])`` (a tensor ``[N]`` or a tuple of them, None where not needed) at
    the positions that predict RL micro-batch ``mb``'s response tokens. An engine under sequence parallelism returns
    :class:`~rlctl.engines.ulysses.ShardedLogits`: each rank computes its positions' and the ``[N]``
    values are gathered (no ``[N, V]`` logits are)."""
    from rlctl.engines.ulysses import ShardedLogits

    if isinstance(output, ShardedLogits):
        whole = mb.logit_index if mb.keep_cols is not None else torch.arange(mb.labels.numel(), device=mb.labels.device)
        return output.per_token(whole, mb.labels, fn)
    if isinstance(output, VocabParallelLogits):
        out = fn(output.rows(mb.at_response(output.local)), mb.labels)
        return out if isinstance(out, tuple) else (out,)
    out = fn(mb.at_response(output), mb.labels)
    return out if isinstance(out, tuple) else (out,)


def response_pairs(output, other, mb, fn: Callable) -> torch.Tensor:
    """``fn(logits [N, V], other_logits [N, V']) -> [N]`` at the positions that predict ``mb``'s response tokens,
    from two models' outputs of the same micro-batch (a student's and a teacher's). Under sequence parallelism
    both are :class:`~rlctl.engines.ulysses.ShardedLogits` of the same columns: each rank computes its positions
    and the ``[N]`` values are gathered."""
    from rlctl.engines.ulysses import ShardedLogits

    if isinstance(output, ShardedLogits):
        whole = mb.logit_index if mb.keep_cols is not None else torch.arange(mb.labels.numel(), device=mb.labels.device)
        return output.per_token(whole, mb.labels, lambda rows, paired, _: fn(rows, paired), paired=other)[0]
    return fn(mb.at_response(output), mb.at_response(other))


def position_tokens(output, labels: torch.Tensor, fn: Callable) -> torch.Tensor:
    """``fn(logits [M, V], labels [M]) -> [M]`` at every position of ``labels`` ``[B, T]`` (SFT), flat."""
    from rlctl.engines.ulysses import ShardedLogits

    if isinstance(output, ShardedLogits):
        return output.per_token(torch.arange(labels.numel(), device=labels.device), labels.reshape(-1), fn)[0]
    return fn(output.reshape(-1, output.shape[-1]), labels.reshape(-1))


def full_logits(output) -> torch.Tensor:
    """The logits ``[B, K, V]`` of an engine's output, gathered where sequence or tensor parallelism split them."""
    return output.full() if hasattr(output, "full") else output


@dataclass(frozen=True)
class VocabShard:
    """This rank's columns ``[start, start + width)`` of a vocabulary split over the ranks of ``group``
    (:meth:`TrainEngine.vocab_shard`); ``width`` is already cut at the vocabulary's end (0 on a rank that
    holds only padding)."""

    group: Any
    start: int
    width: int


@dataclass(frozen=True)
class VocabParallelLogits:
    """An engine's logits split over the vocabulary (Megatron's tensor parallelism): ``padded`` ``[B, T, P]`` are
    this rank's ``P`` columns of the padded vocabulary, of which the first ``shard.width`` are real (of a
    ``vocab_size`` vocabulary). Per-token values come from :func:`response_tokens` (a
    :class:`~rlctl.algos.vocab_parallel.VocabSlice`); nothing gathers the vocabulary but :meth:`full`."""

    padded: torch.Tensor
    shard: VocabShard
    vocab_size: int

    @property
    def local(self) -> torch.Tensor:
        """``[B, T, shard.width]``: this rank's columns of the vocabulary, without padding."""
        return self.padded[..., : self.shard.width]

    def rows(self, local: torch.Tensor):
        """Rows ``[N, shard.width]`` of :attr:`local` as a :class:`~rlctl.algos.vocab_parallel.VocabSlice`."""
        from rlctl.algos.vocab_parallel import VocabSlice

        return VocabSlice(local, self.shard.start, self.shard.group)

    def columns(self, cols: torch.Tensor) -> VocabParallelLogits:
        """These logits at sequence columns ``cols`` only (SFT / DPO at their labelled columns: Megatron's head
        runs at every position, :meth:`rlctl.data.packing.MicroBatch.at_labelled` cuts it)."""
        return replace(self, padded=self.padded[:, cols])

    def sum(self) -> torch.Tensor:
        """A dummy micro-batch's zero loss (``output.sum() * 0``) reaches the whole model."""
        return self.padded.sum()

    def full(self) -> torch.Tensor:
        """The logits ``[B, T, vocab_size]``, gathered over the group (a test hook's dump; differentiable)."""
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(self.padded.contiguous(), group=self.shard.group), -1)[..., : self.vocab_size]


#: ``loss_fn(output, micro_batch) -> (loss or None, result)``, see :meth:`TrainEngine.forward_backward`.
LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor | None, Any]]


def detached(result: Any) -> Any:
    """A loss_fn result (a tensor, a dict of tensors, or plain values) without autograd history."""
    if isinstance(result, torch.Tensor):
        return result.detach()
    if isinstance(result, dict):
        return {k: detached(v) for k, v in result.items()}
    return result


# ---------------------------------------------------------------------------------------------
# Where the model's files come from


@dataclass(frozen=True)
class ModelSource:
    """A model to load: a local directory or a hub id, or only a config for random weights."""

    path: str  # local directory or HF id (from_pretrained accepts both)
    random_init: bool  # build from the config with random weights instead of loading weights
    config_dict: dict | None = None  # set when the config comes from the catalog (random_init, no files)

    def load_config(self):
        from transformers import AutoConfig, PretrainedConfig

        if self.config_dict is not None:
            d = dict(self.config_dict)
            return AutoConfig.for_model(d.pop("model_type"), **d) if "model_type" in d else PretrainedConfig(**d)
        try:
            return AutoConfig.from_pretrained(self.path)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the model config of '{self.path}': {str(e).splitlines()[0]}") from None


def model_source(name: str, *, random_init: bool = False) -> ModelSource:
    """Resolve ``model.name``: a local HF directory (or its config.json), else a catalog name / HF id."""
    if not name:
        raise UserError("no model given: pass --model (a catalog name, HF id or local directory)")
    p = Path(name).expanduser()
    if p.is_file() and p.name == "config.json":
        p = p.parent
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(f"{p} has no config.json; pass a Hugging Face model directory")
        return ModelSource(str(p), random_init)
    from rlctl.catalog import hf_config_dict, resolve_model

    spec = resolve_model(name)
    # A hub id as written keeps its variant (the catalog maps Qwen/Qwen2.5-7B-Instruct to the base entry).
    path = name if "/" in name else spec.hf_id
    return ModelSource(path, random_init, hf_config_dict(spec) if random_init else None)


def load_tokenizer(source: ModelSource):
    """The tokenizer beside the model (fast tokenizers give offsets for exact loss masks)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot load a tokenizer from '{source.path}': {str(e).splitlines()[0]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_vision_processor(source: ModelSource, tokenizer):
    """A vision-language model's :class:`rlctl.data.vision.VisionProcessor` (its image processor and
    ``tokenizer``), or None for a text model."""
    from rlctl.data.vision import is_vision_config, load_processor

    return load_processor(source.path, tokenizer) if is_vision_config(source.load_config()) else None


def write_model_meta(out_dir: str | Path, hf_config, tokenizer, source: ModelSource, *, vision=None) -> Path:
    """Write config.json, generation_config.json and the tokenizer files (and a VL model's image processor,
    ``vision``): what makes a checkpoint self-describing; exports copy them."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    if vision is not None:
        vision.image_processor.save_pretrained(str(out))
    try:
        gen = GenerationConfig.from_pretrained(source.path)
    except (OSError, ValueError):
        gen = GenerationConfig.from_model_config(hf_config)
    gen.save_pretrained(str(out))
    return out
