"""Run under torchrun (2 ranks, gloo): a vLLM rollout engine on every rank of an initialised world.

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 vllm_colocated.py MODEL_DIR
Each rank generates a different number of prompts and tokens, pushes weights, shuts its engine
down (close() on rank 0, garbage collection on rank 1), then checks that the trainer's process
group and environment survived. Prints "colocated rank ok" per rank and exits 0.
"""

from __future__ import annotations

import gc
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import rlctl.rollout.vllm  # noqa: F401  (importing vllm sets variables of its own, e.g. via cv2)
from rlctl.rollout import RolloutSpec, SamplingParams, make_rollout_engine


def main(model_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    env_before = dict(os.environ)

    engine = make_rollout_engine(
        RolloutSpec(engine="vllm", model_path=model_dir, device="cpu", dtype="float32", max_model_len=64, seed=rank)
    )
    # Starting the engine must not change anything the trainer had (vLLM sets LOCAL_WORLD_SIZE...).
    changed = {k for k, v in env_before.items() if os.environ.get(k) != v}
    assert not changed, f"vLLM changed the trainer's environment: {changed}"

    # Ranks are independent: different prompt counts and lengths, no lock-step needed.
    prompts = [[5 + rank, 6, 7]] * (1 + rank)
    samples = engine.generate(
        prompts, n=2, sampling=SamplingParams(temperature=1.0, max_tokens=4 + 3 * rank, seed=rank)
    )
    assert len(samples) == 2 * len(prompts)
    assert all(len(s.token_ids) == len(s.logprobs) for s in samples)

    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    engine.update_weights(iter(weights.items()))
    engine.generate(prompts, n=1, sampling=SamplingParams(temperature=0, max_tokens=3))

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert total.item() == 3.0

    # Rank 0 closes its engine; rank 1 just drops it (vLLM then shuts down on garbage collection).
    if rank == 0:
        engine.close()
    else:
        shutdown = engine._shutdown
        del engine
        gc.collect()
        assert not shutdown.alive, "dropping the engine did not shut vLLM down"
    assert dist.is_initialized(), "shutting vLLM down destroyed the trainer's process group"
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    assert total.item() == 2.0
    dist.destroy_process_group()
    print("colocated rank ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
