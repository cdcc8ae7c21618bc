"""Model FLOPs per token, the device's peak, and MFU.

Convention (PaLM, Chowdhery et al. 2022, appendix B; Megatron-LM's and verl's MFU count the same
terms)::

    forward FLOPs per token   = 2 * N + 2 * L * s * (d_qk + d_v)
    training FLOPs per token  = 3 * forward = 6 * N + 6 * L * s * (d_qk + d_v)

* ``N``: the parameters each token is multiplied by: every decoder-layer parameter (for MoE only
  the ``experts_per_token`` routed experts, the shared experts and the router), the final norm and
  the output projection. The output projection counts even when it is tied to the input embedding
  (the matmul runs either way); the input embedding does not (a lookup). Norm weights and biases are
  included although they are not matmuls (they are under 0.1% of N).
* Attention: per layer and token, ``Q K^T`` and ``A V`` take ``2 * s * d_qk`` and ``2 * s * d_v``
  FLOPs with ``d_qk = heads * qk_head_dim`` and ``d_v = heads * v_head_dim`` (both ``heads *
  head_dim`` for standard attention, which gives PaLM's ``12 * L * H * Q * T`` for training).
  ``s`` is the full sequence length: the half the causal mask skips is counted, as PaLM does.
* Backward = 2 x forward. Recomputation (activation checkpointing) is not counted: this is MFU,
  not hardware FLOPs utilisation.

MFU = model FLOPs / seconds / peak FLOP/s of all the devices used. On GPUs the peak is the
catalog's dense bf16 figure (:class:`rlctl.catalog.GpuSpec.bf16_tflops`); on CPUs it is measured:
the best rate of an fp32 matmul with the same threads per process, times the processes.
"""

from __future__ import annotations

from rlctl.catalog import active_params, embedding_params
from rlctl.catalog.spec import ModelSpec


def flops_params(spec: ModelSpec) -> int:
    """``N``: parameters multiplied per token (see the module docstring)."""
    n = active_params(spec) - embedding_params(spec)
    if spec.tie_embeddings:  # the lm_head matmul runs with the embedding matrix
        n += embedding_params(spec)
    return n


def attention_dims(spec: ModelSpec) -> tuple[int, int]:
    """(d_qk, d_v): widths of the query-key and value products of one layer."""
    if spec.uses_mla:
        return (spec.num_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim), spec.num_heads * spec.v_head_dim)
    return spec.num_heads * spec.head_dim, spec.num_heads * spec.head_dim


def forward_flops_per_token(spec: ModelSpec, seq_len: float) -> float:
    """One forward pass, per token of a ``seq_len``-token sequence."""
    d_qk, d_v = attention_dims(spec)
    return 2 * flops_params(spec) + 2 * spec.num_layers * seq_len * (d_qk + d_v)


def train_flops_per_token(spec: ModelSpec, seq_len: float) -> float:
    """Forward and backward, per token."""
    return 3 * forward_flops_per_token(spec, seq_len)


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak."""
    if seconds <= 0 or peak_flops <= 0:
        raise ValueError("seconds and peak_flops must be positive")
    return flops / seconds / peak_flops


def gpu_peak_flops(gpu_name: str) -> float:
    """Dense bf16 peak FLOP/s of one GPU, from the catalog."""
    from rlctl.catalog import resolve_gpu

    return resolve_gpu(gpu_name).bf16_tflops * 1e12


def matmul_rate(n: int = 1024, seconds: float = 1.0) -> float:
    """Best fp32 FLOP/s of ``n x n`` matmuls in this process (its torch thread count), over ``seconds``."""
    import time

    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # warm up
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n**3 / (time.perf_counter() - t))
    return best


def measure_cpu_peak(threads: int, *, n: int = 1024, seconds: float = 1.0) -> float:
    """fp32 matmul peak of one process with ``threads`` threads, measured in a fresh process."""
    from rlctl.bench.common import run_measured, stdout_value

    code = f"from rlctl.bench.mfu import matmul_rate\nprint('RATE', matmul_rate({n}, {seconds}), flush=True)"
    _, _, out = run_measured(code, threads=threads)
    return stdout_value(out, "RATE")
