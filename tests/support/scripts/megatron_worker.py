"""Run rlctl's MegatronEngine on CPU under gloo (one process per rank; torchrun for more).

    python worker.py SPEC.json

SPEC: ``{"batch": "BATCH.pt", "runs": [{"tp", "pp", "model", "out", "load"}, ...]}``. The runs go one
after another in the same processes (megatron-core's parallel state is rebuilt between them). For each
run every rank builds a frozen engine (``build_engine(..., trainable=False)``) from the HF directory
``model`` and writes what it saw into ``out`` for the test to compare with independent computations:

* ``params_rank{r}.pt``: its GPTModel's parameters under their module names, with its tp/pp/dp ranks;
* ``logits.pt`` (rank 0): the logits of the batch in BATCH.pt (``input_ids``, ``position_ids``,
  ``attention_mask``), from ``forward`` when pp=1 and from the pipeline schedule
  (``forward_backward(..., forward_only=True)``) always;
* ``full.pt`` (rank 0): every HF tensor of ``iter_full_params`` (gathered over TP and PP);
* ``ckpt/``: ``save_checkpoint`` (megatron-core dist_checkpointing, torch_dist).

With ``load`` set (a dist checkpoint, maybe saved at another tp/pp) the engine starts from random
weights (``model.random_init``) and loads the checkpoint before all of the above.

Training (DDP + DistributedOptimizer) runs in the recipe tests instead (recipe.py: the sft and grpo
recipes on the Megatron engine, compared with FSDP runs).
"""

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
from megatron.core import parallel_state

from rlctl.engines import build_engine
from rlctl.engines.base import VocabParallelLogits
from rlctl.engines.spec import EngineSpec


def make(hf_dir: str, tp: int, pp: int, random_init: bool = False):
    spec = EngineSpec(
        backend="megatron",
        device="cpu",
        dtype="fp32",
        tp=tp,
        pp=pp,
        model=hf_dir,
        random_init=random_init,
        max_seq_len=64,
    )
    return build_engine(spec, role="actor", trainable=False)


def run(spec: dict, batch: dict) -> None:
    rank = dist.get_rank()
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    engine = make(spec["model"], spec["tp"], spec["pp"], random_init=spec.get("load") is not None)
    if spec.get("load"):
        engine.load_checkpoint(spec["load"])
    params = {n: p.detach().clone() for n, p in engine.gpt.named_parameters()}
    torch.save(
        {"tp_rank": engine.tp_rank, "pp_rank": engine.pp_rank, "dp_rank": engine.dp_rank, "params": params},
        out / f"params_rank{rank}.pt",
    )

    logits = {}
    mb = SimpleNamespace(**batch)
    if spec["pp"] == 1:
        with torch.no_grad():
            logits["forward"] = engine.forward(mb.input_ids, mb.position_ids, mb.attention_mask)
    # at tp > 1 the loss gets this rank's vocabulary columns (VocabParallelLogits): gathered here to compare
    whole = lambda lg, m: (None, lg.full() if isinstance(lg, VocabParallelLogits) else lg)  # noqa: E731
    (logits["schedule"],) = engine.forward_backward([mb], whole, forward_only=True)
    full = {name: t.clone() for name, t in engine.iter_full_params()}
    engine.save_checkpoint(out / "ckpt")
    if rank == 0:
        torch.save(logits, out / "logits.pt")
        torch.save(full, out / "full.pt")
    dist.barrier()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    batch = torch.load(spec["batch"])
    for one in spec["runs"]:
        run(one, batch)
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
