"""The Megatron training engine: megatron-core's ``GPTModel`` with tensor, pipeline and data parallelism.

The planner picks ``backend=megatron`` for models too large for FSDP alone (14B-72B dense). The
recipes build their engines with :func:`rlctl.engines.build_engine`, which builds
:class:`rlctl.engines.megatron.engine.MegatronEngine` for that backend; the launch command is the same
torchrun command (the environment of :func:`rlctl.engines.megatron.parallel.megatron_env` added).

How a model is built (every rank, see :class:`MegatronEngine`):

1. ``parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp,
   expert_model_parallel_size=ep)`` once per process (the actor and the reference share it);
2. a ``GPTModel`` for this rank's pipeline stage from the HF config (:func:`transformer_config`):
   RMSNorm, SwiGLU, RoPE with the model's theta, GQA, QKV bias (Qwen2), q/k norm (Qwen3), tied
   embeddings, the vocabulary padded to a multiple of :data:`VOCAB_MULTIPLE` (the same for any tp up
   to 8, so checkpoints reshard across tp). Transformer Engine's layer spec on GPU when installed,
   megatron-core's local spec otherwise. When pp does not divide the layers the last stage holds
   fewer (``num_layers_in_last_pipeline_stage``, :func:`rlctl.engines.megatron.parallel.pipeline_stages`);
3. the rank reads only its slices of the HF safetensors (:func:`stage_shard`), and every parameter
   must be set;
4. trainable models are wrapped in megatron-core's ``DistributedDataParallel`` and get its
   ``DistributedOptimizer`` (AdamW; bf16 parameters with fp32 master weights and fp32 gradient
   reduction on GPU). With the spec's ``offload_optimizer`` the master weights, gradient copies and
   AdamW states live on the CPU, which steps the optimizer (:func:`optimizer_settings`).

Gradients are SUMMED over data-parallel ranks (``calculate_per_token_loss=True``: no averaging by
the DP size nor by the number of micro-batches), as :mod:`rlctl.engines.base` requires. Tensor- and
pipeline-parallel ranks of one data-parallel replica must be fed the same micro-batches
(:attr:`MegatronEngine.dp_rank` / :attr:`~MegatronEngine.dp_size` say which share a rank takes;
sums over the data go over :attr:`~MegatronEngine.dp_group`).

Steps: :meth:`MegatronEngine.forward_backward` (what the recipes call) runs megatron-core's pipeline
schedule (``get_forward_backward_func``) over all micro-batches of a step, for any pp;
:meth:`~MegatronEngine.forward` / :meth:`~MegatronEngine.backward` work when pp = 1.

Packed rows (several documents in one row, positions restarting at 0) are unpacked into one padded
row per document before the model (:func:`unpack_rows`), because megatron-core's RoPE numbers
positions 0..L-1 per row; logits are packed back. :meth:`~MegatronEngine.forward` returns the logits
gathered over TP and cut to the HF vocabulary; ``forward_backward``'s ``loss_fn`` gets them gathered only at
tp 1: at tp > 1 they stay split over the vocabulary (:class:`~rlctl.engines.base.VocabParallelLogits`, read by
:mod:`rlctl.algos.vocab_parallel`).

Checkpoints: :meth:`~MegatronEngine.save_checkpoint` / :meth:`~MegatronEngine.load_checkpoint` use
megatron-core's ``dist_checkpointing`` (torch_dist): every tensor is stored as one global tensor, so a
checkpoint loads at another tp/pp, and ``rlctl convert megatron-to-hf`` reads it.

Modules: :mod:`.config` (HF config -> megatron-core's configs), :mod:`.weights` (the stage's GPTModel, HF
weights in, full HF tensors out), :mod:`.rows` (packed rows), :mod:`.parallel` (pure rank-layout math, no
torch), :mod:`.patches` (version-pinned megatron-core fixes), :mod:`.engine` (:class:`MegatronEngine`).
This package imports none of them itself, so the launcher can read :mod:`.parallel` without torch.
"""

from __future__ import annotations
