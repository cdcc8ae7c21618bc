"""Measure the host memory rlctl's MegatronEngine takes to save a checkpoint (CPU, gloo).

    torchrun --nproc-per-node N megatron_save_host.py HF_DIR OUT

One bf16 engine (tp 1, pp 1, dp N; random weights from HF_DIR's config.json) steps once so that AdamW
has its states, then ``engine.save_checkpoint`` runs as in training. ``megatron.core.dist_checkpointing.save``
is wrapped (at the boundary between the two halves of a save) to read the process's resident memory:

* ``gather_peak``: the peak of the resident set (``VmHWM``, reset through ``/proc/self/clear_refs``)
  while ``engine._sharded_state`` builds the state dict (the distributed optimizer's
  ``fully_reshardable`` gather), minus the resident set before the save;
* ``held``: what is still resident when the state dict is handed to ``dist_checkpointing.save``;
* ``write_peak``: the peak while ``dist_checkpointing.save`` writes, minus the resident set before the save.

Each rank writes ``OUT/rank{r}.json`` with these and the sizes the formula needs: ``buffer_numel`` (the
elements of its gradient buffers, unpadded: its tp/pp shard of the parameters), ``bucket_numel`` (the
padded elements of each bucket), ``dp`` and ``dp_rank``, ``written_numel`` (the parameters this rank
writes: those whose replica id is all zeros). Run with ``MALLOC_MMAP_THRESHOLD_=65536`` so that every
tensor of more than 64 KiB is its own mapping and returns to the system when freed.
"""

import gc
import json
import os
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).parent))

import megatron_cpu_patches  # noqa: F401  (before megatron.core)
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from rlctl.engines import build_engine
from rlctl.engines.spec import EngineSpec


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def next_token_loss(logits: torch.Tensor, mb) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb.input_ids[:, 1:, None])
    loss = -logp.mean()
    return loss, loss.detach()


def written_numel(state: dict) -> int:
    """Elements of the model's sharded tensors that this rank writes (replica id all zeros)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    total = 0
    for sh in nested_values(state["model"]):
        rid = sh.replica_id if isinstance(sh.replica_id, tuple) else (sh.replica_id,)
        if isinstance(sh, ShardedTensor | ShardedTensorFactory) and all(r == 0 for r in rid):
            total += sh.data.numel()
    return total


def main() -> None:
    hf_dir, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = EngineSpec(backend="megatron", device="cpu", dtype="bf16", model=hf_dir, random_init=True, max_seq_len=64)
    engine = build_engine(spec, role="actor", trainable=True, total_steps=10)
    torch.manual_seed(0)
    batch = SimpleNamespace(
        input_ids=torch.randint(0, 200, (2, 12)), position_ids=torch.arange(12).expand(2, 12), attention_mask=None
    )
    engine.forward_backward([batch], next_token_loss)
    engine.step()
    record = {
        "dp": engine.dp_size,
        "dp_rank": engine.dp_rank,
        "buffer_numel": sum(b.numel_unpadded for b in engine.model.buffers),
        "bucket_numel": [bk.grad_data.numel() for b in engine.model.buffers for bk in b.buckets],
        "written_numel": written_numel({"model": engine.gpt.sharded_state_dict()}),
        "param_bytes": engine.gpt.embedding.word_embeddings.weight.element_size(),
    }
    save = dist_checkpointing.save

    def measured_save(state, path, *args, **kwargs):
        record["gather_peak"] = _status("VmHWM") - record["before"]
        record["held"] = _status("VmRSS") - record["before"]
        _reset_peak()
        result = save(state, path, *args, **kwargs)
        record["write_peak"] = _status("VmHWM") - record["before"]
        return result

    dist_checkpointing.save = measured_save
    gc.collect()
    dist.barrier()
    record["before"] = _status("VmRSS")
    _reset_peak()
    engine.save_checkpoint(out / "ckpt")
    dist_checkpointing.save = save
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
