"""The Megatron engine itself: :class:`MegatronEngine` (see the package docstring for how it works)."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlctl.engines.base import LossFn, ModelSource, TrainEngine, VocabParallelLogits, VocabShard, detached
from rlctl.engines.megatron import config as mconfig
from rlctl.engines.megatron.parallel import CUDA_MAX_CONNECTIONS, check_megatron_layout, layer_stages
from rlctl.engines.megatron.patches import init_torch_adam_state, torch_adam_load_fix
from rlctl.engines.megatron.rows import Unpacked, moved, unpack_rows
from rlctl.engines.megatron.weights import StageGather, build_gpt_model, in_stage, layout_state, load_hf_weights
from rlctl.engines.spec import EngineSpec
from rlctl.errors import UserError
from rlctl.formats.megatron_layout import megatron_to_hf


def init_model_parallel(tp: int, pp: int, cp: int = 1, ep: int = 1, *, seed: int = 0, cuda: bool = False) -> None:
    """Start megatron-core's parallel state (once per process; a second engine must use the same sizes)."""
    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        have = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_context_parallel_world_size(),
            parallel_state.get_expert_model_parallel_world_size(),
        )
        if have != (tp, pp, cp, ep):
            raise RuntimeError(f"megatron parallel state already set to tp/pp/cp/ep {have}, not {(tp, pp, cp, ep)}")
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
    )
    if cuda:  # TP weight init and dropout draw from megatron's CUDA RNG tracker
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


class MegatronEngine(TrainEngine):
    """One model split by megatron-core (TP x PP, replicated over DP), with its optimizer when trainable.

    The constructor mirrors :class:`rlctl.engines.fsdp.FSDPEngine` (same arguments); spec fields used:
    model, device, dtype, tp, pp, cp, ep, sequence_parallel, activation_checkpointing, offload_params,
    offload_optimizer, seed, max_seq_len, optimizer (no LoRA, no critic).
    """

    backend = "megatron"

    def __init__(
        self,
        spec: EngineSpec,
        *,
        role: str = "actor",
        trainable: bool = True,
        total_steps: int = 0,
        source: ModelSource | None = None,
    ):
        self._refuse_unsupported(spec, role, trainable)
        mconfig.require_megatron_core()
        self._setup(spec, role=role, trainable=trainable, total_steps=total_steps, source=source)
        self.cuda = spec.device == "cuda"
        self.offload_optimizer = spec.offload_optimizer and trainable and self.cuda
        from megatron.core import parallel_state

        if spec.dtype not in mconfig.DTYPES:
            raise UserError(f"the megatron engine trains in bf16 or fp32, not {spec.dtype}; set model.dtype=bf16")
        self.compute_dtype = mconfig.DTYPES[spec.dtype]
        self.tp, self.pp = spec.tp, spec.pp
        self.sequence_parallel = spec.sequence_parallel and self.tp > 1
        hf = self.hf_config.to_dict()
        self._check_layout(spec, hf)

        init_model_parallel(self.tp, self.pp, spec.cp, spec.ep, seed=spec.seed, cuda=self.cuda)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.gpt = self._build_gpt(spec, hf)
        self.optimizer = None
        self.model: torch.nn.Module = self.gpt
        if trainable:
            self._wrap_ddp_and_optimizer()
        else:
            self.gpt.requires_grad_(False)
        self.train(trainable)

    def _check_layout(self, spec: EngineSpec, hf: dict) -> None:
        """The model's layout against tp / pp / cp / ep, its rope and sliding window; the CUDA setting TP needs."""
        self.layout = mconfig.layout_config(hf, self.tp)
        world = dist.get_world_size()
        check_megatron_layout(self.layout, world=world, tp=self.tp, pp=self.pp, cp=spec.cp, ep=spec.ep)
        mconfig.rope(hf)
        mconfig.check_sliding_window(hf, spec.max_seq_len)
        if self.cuda and (self.tp > 1 or self.sequence_parallel) and os.environ.get(CUDA_MAX_CONNECTIONS) != "1":
            print(
                f"warning: {CUDA_MAX_CONNECTIONS}=1 is not set; megatron-core's TP communication overlap "
                f"needs it (rlctl's launcher sets it)",
                file=sys.stderr,
                flush=True,
            )

    def _build_gpt(self, spec: EngineSpec, hf: dict) -> torch.nn.Module:
        """megatron-core's GPTModel of this rank's stage and TP shard, with the HF weights (unless random)."""
        self.config = mconfig.transformer_config(
            hf,
            tp=self.tp,
            pp=self.pp,
            cp=spec.cp,
            ep=spec.ep,
            sequence_parallel=self.sequence_parallel,
            dtype=self.compute_dtype,
            cuda=self.cuda,
            recompute=self.trainable and spec.activation_checkpointing,
        )
        torch.manual_seed(spec.seed)
        gpt = build_gpt_model(hf, self.config, tp=self.tp, cuda=self.cuda)
        if self.cuda:
            gpt.cuda(self.device)
        if not self.source.random_init:
            self._load_hf(gpt)
        return gpt

    # ------------------------------------------------------------------ setup

    @staticmethod
    def _refuse_unsupported(spec: EngineSpec, role: str, trainable: bool) -> None:
        """UserError for what this engine does not run: a critic, LoRA, parameter offload, optimizer offload
        without Transformer Engine."""
        if role == "critic":
            raise UserError(
                "the PPO critic is not supported by the megatron engine yet; "
                "use method grpo, or parallel.backend=fsdp for ppo"
            )
        if trainable and spec.lora.rank > 0:
            raise UserError("LoRA is not supported by the megatron engine; set lora.rank=0 or parallel.backend=fsdp")
        if spec.offload_params:
            raise UserError(
                "parallel.offload_params (weights on the CPU between phases) is not supported by the "
                "megatron engine yet; set parallel.offload_params=false (parallel.offload_optimizer=true "
                "keeps the optimizer on the CPU) or use more GPUs"
            )
        if spec.offload_optimizer and trainable and spec.device == "cuda" and not mconfig.have_transformer_engine():
            raise UserError(
                "parallel.offload_optimizer on the megatron engine needs Transformer Engine "
                "(megatron-core's precision-aware optimizer): pip install 'transformer-engine[pytorch]', "
                "or set parallel.offload_optimizer=false"
            )

    def _load_hf(self, gpt: torch.nn.Module) -> None:
        from rlctl.formats.safetensors import HFSafetensors

        load_hf_weights(
            gpt,
            HFSafetensors(Path(self.source.path)),
            self.layout,
            tp=self.tp,
            pp=self.pp,
            tp_rank=self.tp_rank,
            pp_rank=self.pp_rank,
        )

    def _wrap_ddp_and_optimizer(self) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=True,
            overlap_grad_reduce=False,
            check_for_nan_in_grad=True,
        )
        self.model = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=self.gpt)
        if self.source.random_init:
            self.model.broadcast_params()  # the same random weights on every data-parallel replica
        settings = mconfig.optimizer_settings(
            self.spec.optimizer,
            lr=self.peak_lr * self._lr_factor(0),
            dtype=self.compute_dtype,
            offload=self.offload_optimizer,
        )
        self.optimizer = get_megatron_optimizer(OptimizerConfig(**settings), [self.model])
        # the pipeline schedule syncs gradients through these hooks; no per-token scaling (the
        # recipe's loss is already normalised by the global token count)
        self.config.no_sync_func = self.model.no_sync
        self.config.finalize_model_grads_func = lambda models, num_tokens=None, **kw: finalize_model_grads(
            models, None, **kw
        )

    # ------------------------------------------------------------------ training

    def _run(self, model, unpacked: Unpacked, *, gather: bool = True) -> torch.Tensor:
        """This stage of the model on unpacked rows: hidden states, or on the last stage the logits over
        the padded vocabulary [N, L, V'] (gathered over TP), or with ``gather=False`` this TP rank's V'/tp."""
        n, width = unpacked.tokens.shape
        positions = torch.arange(width, device=self.device).expand(n, width)
        return model(unpacked.tokens, positions, attention_mask=self._causal_mask(width), runtime_gather_output=gather)

    def _loss_input(self, up: Unpacked, output: torch.Tensor):
        """What ``loss_fn`` gets of the last stage's output: the logits over the HF vocabulary at tp 1; at tp > 1
        this rank's columns, never gathered (:class:`VocabParallelLogits`: the loss's log-probs, entropy and
        reverse KL all-reduce their max and sums over TP instead, :mod:`rlctl.algos.vocab_parallel`)."""
        if self.tp == 1:
            return up.repack(output[..., : self.layout.vocab_size])
        shard = self.vocab_shard(self.layout.vocab_size)
        return VocabParallelLogits(up.repack(output), shard, self.layout.vocab_size)

    def _causal_mask(self, width: int) -> torch.Tensor | None:
        """megatron-core builds its causal mask on CUDA; on CPU (tests) it must be passed (True = hidden)."""
        if self.cuda:
            return None
        return torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)[None, None]

    def _unpack(self, input_ids, position_ids, attention_mask=None) -> Unpacked:
        return unpack_rows(
            input_ids.to(self.device),
            position_ids.to(self.device),
            None if attention_mask is None else attention_mask.to(self.device),
            multiple=self.tp if self.sequence_parallel else 1,
        )

    def _single_stage(self, what: str) -> None:
        if self.pp > 1:
            raise RuntimeError(f"MegatronEngine.{what} needs pp=1; with pipeline parallelism use forward_backward()")

    def forward(self, input_ids, position_ids, attention_mask=None) -> torch.Tensor:
        """Logits [B, T, V] over the HF vocabulary (pp=1 only; gathered over TP)."""
        self._single_stage("forward")
        unpacked = self._unpack(input_ids, position_ids, attention_mask)
        return unpacked.repack(self._run(self.model, unpacked)[..., : self.layout.vocab_size])

    def vocab_shard(self, vocab_size: int) -> VocabShard | None:
        """This TP rank's columns of a ``vocab_size`` vocabulary (a student's, this engine a teacher's), padded
        like this engine's; a UserError where the padding splits the two vocabularies at other columns."""
        if self.tp == 1:
            return None
        from megatron.core import parallel_state

        from rlctl.formats.megatron_layout import padded_vocab_size

        mine = padded_vocab_size(self.layout, self.tp)
        theirs = padded_vocab_size(dataclasses.replace(self.layout, vocab_size=vocab_size), self.tp)
        if theirs != mine:
            raise UserError(
                f"algo.distill=full at tp={self.tp}: the teacher's vocabulary ({self.layout.vocab_size} rows, "
                f"padded to {mine}) is split over the TP ranks at other columns than the student's ({vocab_size}, "
                f"padded to {theirs}); use algo.distill=sampled or a teacher with the student's embedding size"
            )
        width = mine // self.tp
        start = self.tp_rank * width
        group = parallel_state.get_tensor_model_parallel_group()
        return VocabShard(group, start, max(0, min(width, vocab_size - start)))

    def forward_vocab_shard(self, mb) -> torch.Tensor:
        """Logits ``[B, T, width]`` of this TP rank's vocabulary columns (:meth:`vocab_shard` of this engine's
        own vocabulary), not gathered over TP (pp=1 only)."""
        self._single_stage("forward_vocab_shard")
        shard = self.vocab_shard(self.layout.vocab_size)
        up = self._unpack(mb.input_ids, mb.position_ids, mb.attention_mask)
        return up.repack(self._run(self.model, up, gather=False)[..., : shard.width])

    def backward(self, loss: torch.Tensor, *, sync: bool = True) -> None:
        """Accumulate gradients (pp=1); on ``sync`` reduce them over DP (and TP for sequence-parallel norms)."""
        if not self.trainable:
            raise RuntimeError(f"the {self.role} engine is frozen")
        self._single_stage("backward")
        loss.backward()
        if sync:
            self.config.finalize_model_grads_func([self.model])

    def forward_backward(
        self, micro_batches: Sequence[Any], loss_fn: LossFn, *, forward_only: bool = False
    ) -> list[Any]:
        """Run ``micro_batches`` through megatron-core's pipeline schedule (any pp); collective over the
        model-parallel group. The contract of :meth:`TrainEngine.forward_backward`: ``loss_fn(logits
        [B, T, V], mb) -> (loss, result)`` runs on the last pipeline stage, and its results are sent to
        the other stages, so every rank gets them. Training leaves the gradients reduced over DP.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not forward_only and not self.trainable:
            raise RuntimeError(f"the {self.role} engine is frozen")
        unpacked = [self._unpack(mb.input_ids, mb.position_ids, mb.attention_mask) for mb in micro_batches]
        data = iter(zip(micro_batches, unpacked))

        def step_fn(data_iterator, model):
            mb, up = next(data_iterator)
            return self._run(model, up, gather=self.tp == 1), partial(loss_func, mb, up)

        def loss_func(mb, up, output, non_loss_data=False):
            loss, result = loss_fn(self._loss_input(up, output), mb)
            if non_loss_data:  # forward_only
                return detached(result)
            # (calculate_per_token_loss: the schedule neither divides by this count nor by the micro-batches)
            return loss, torch.ones((), dtype=torch.int, device=self.device), {"result": detached(result)}

        with torch.set_grad_enabled(not forward_only):
            results = get_forward_backward_func()(  # (shapes are sent between stages: variable_seq_lengths)
                forward_step_func=step_fn,
                data_iterator=data,
                model=[self.model],
                num_microbatches=len(micro_batches),
                seq_length=max((up.tokens.shape[1] for up in unpacked), default=1),
                micro_batch_size=max((up.tokens.shape[0] for up in unpacked), default=1),
                forward_only=forward_only,
                collect_non_loss_data=forward_only,
            )
        return self._from_last_stage([r if forward_only else r["result"] for r in results])

    def _from_last_stage(self, results: list[Any]) -> list[Any]:
        """The last pipeline stage's results on every stage of the pipeline."""
        if self.pp == 1:
            return results
        from megatron.core import parallel_state

        box = [moved(results, "cpu") if parallel_state.is_pipeline_last_stage() else None]
        dist.broadcast_object_list(
            box,
            src=parallel_state.get_pipeline_model_parallel_last_rank(),
            group=parallel_state.get_pipeline_model_parallel_group(),
            device=self.device,
        )
        return moved(box[0], self.device)

    # ------------------------------------------------------------------ data-parallel coordinates

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @property
    def mp_size(self) -> int:
        return self.tp * self.pp

    @property
    def mp_group(self) -> dist.ProcessGroup:
        from megatron.core import parallel_state

        return parallel_state.get_model_parallel_group()

    def step(self) -> float:
        """Clip, step the distributed optimizer at the current lr, zero gradients; the global grad norm."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        _, grad_norm, _ = self.optimizer.step()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self.global_step += 1
        return float(grad_norm) if grad_norm is not None else float("nan")

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """megatron-core's sharded state dict {"model", "optimizer", "scheduler"} for ``dist_checkpointing``."""
        return self._sharded_state(is_loading=False)

    def _sharded_state(self, *, is_loading: bool) -> dict:
        model_state = self.gpt.sharded_state_dict()  # the GPTModel's names, without DDP's "module." prefix
        state = {"model": model_state}
        if self.trainable:
            state["optimizer"] = self.optimizer.sharded_state_dict(
                model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
            )
            state["scheduler"] = {"step": self.global_step}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``dist_checkpointing.load`` returned for :meth:`state_dict`."""
        self.gpt.load_state_dict(state["model"])
        if self.trainable and "optimizer" in state:
            with torch_adam_load_fix(self.optimizer):
                self.optimizer.load_state_dict(state["optimizer"])
            self.global_step = int(state["scheduler"]["step"])

    def save_checkpoint(self, path: str | Path) -> None:
        """Write model (+ optimizer, schedule) as a torch_dist dist checkpoint into ``path`` (collective)."""
        from megatron.core import dist_checkpointing

        Path(path).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(is_loading=False), str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint`, at any tp/pp (collective)."""
        from megatron.core import dist_checkpointing

        if not (Path(path) / "metadata.json").is_file():
            raise UserError(
                f"{path} is not a megatron-core dist checkpoint (no metadata.json); "
                f"was it saved with parallel.backend=fsdp?"
            )
        if self.trainable:
            init_torch_adam_state(self.optimizer)
        self.load_state_dict(dist_checkpointing.load(self._sharded_state(is_loading=True), str(path)))

    # ------------------------------------------------------------------ full weights

    def iter_full_params(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor on this engine's device) for every weight, on every rank, layer by layer.

        Each tensor is gathered over TP and sent from its pipeline stage to the others, one at a time.
        As in :func:`stage_shard`, every layer is read as the one layer of a ``pp = num_layers`` split.
        """
        gather = StageGather(layout_state(self.gpt), self.tp, self.pp, self.device, self.compute_dtype)
        where = layer_stages(self.layout.num_layers, self.pp)

        def get(tp_rank: int, layer: int, name: str) -> torch.Tensor:
            stage, local = where[layer]
            return gather(tp_rank, stage, in_stage(name, local))

        for name, t in megatron_to_hf(get, self.layout, self.tp, self.layout.num_layers):
            yield name, t.to(dtype) if dtype is not None else t
