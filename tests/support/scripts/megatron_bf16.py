"""Train rlctl's MegatronEngine in bf16 on CPU under gloo, checkpoint it, load it into a fresh engine.

    torchrun --nproc-per-node PP megatron_bf16.py HF_DIR OUT

bf16 is what every GPU run uses (the other CPU tests run fp32). One replica split over PP pipeline
stages (tp 1, dp 1). Each rank writes ``OUT/rank{r}.pt``:

* ``dtypes``: every GPTModel parameter's dtype;
* ``live``: after 2 optimizer steps, each parameter's fp32 main copy, exp_avg and exp_avg_sq, found
  through the parameter's own ``main_param`` link (set by megatron-core's distributed optimizer when it
  makes the fp32 copy) rather than through the optimizer's group/order map the checkpoint uses;
* ``loaded``: the same, in a second engine (random weights) after ``load_checkpoint``;
* ``params`` / ``loaded_params``: both engines' parameters.

Rank 0 also writes ``OUT/full.pt``: ``iter_full_params`` of the trained engine (the HF export's stream,
gathered over the pipeline). The checkpoint is ``OUT/ckpt``.
"""

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

from rlctl.engines import build_engine
from rlctl.engines.spec import EngineSpec


def make(hf_dir: str, pp: int, random_init: bool):
    spec = EngineSpec(
        backend="megatron", device="cpu", dtype="bf16", pp=pp, model=hf_dir, random_init=random_init, max_seq_len=64
    )
    return build_engine(spec, role="actor", trainable=True, total_steps=10)


def optimizer_states(engine) -> dict[str, dict[str, torch.Tensor]]:
    (opt,) = engine.optimizer.chained_optimizers
    out = {}
    for name, p in engine.gpt.named_parameters():
        main = p.main_param  # fp32 copy of this bf16 parameter (dp 1: all of it)
        state = opt.optimizer.state[main]
        out[name] = {
            "param": main.detach().clone(),
            **{k: state[k].detach().clone() for k in ("exp_avg", "exp_avg_sq")},
        }
    return out


def next_token_loss(logits: torch.Tensor, mb) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb.input_ids[:, 1:, None])
    loss = -logp.mean()
    return loss, loss.detach()


def main() -> None:
    hf_dir, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    batch = SimpleNamespace(
        input_ids=torch.randint(0, 200, (2, 12)), position_ids=torch.arange(12).expand(2, 12), attention_mask=None
    )
    engine = make(hf_dir, pp, random_init=False)
    for _ in range(2):
        engine.forward_backward([batch], next_token_loss)
        engine.step()
    engine.save_checkpoint(out / "ckpt")
    record = {
        "dtypes": {n: p.dtype for n, p in engine.gpt.named_parameters()},
        "live": optimizer_states(engine),
        "params": {n: p.detach().clone() for n, p in engine.gpt.named_parameters()},
    }
    full = {name: t.clone() for name, t in engine.iter_full_params()}

    fresh = make(hf_dir, pp, random_init=True)
    fresh.load_checkpoint(out / "ckpt")
    record["loaded"] = optimizer_states(fresh)
    record["loaded_params"] = {n: p.detach().clone() for n, p in fresh.gpt.named_parameters()}
    record["loaded_step"] = fresh.global_step
    torch.save(record, out / f"rank{rank}.pt")
    if rank == 0:
        torch.save(full, out / "full.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
