"""Write real FSDP2 checkpoints for tests/convert/test_convert.py (run with torchrun --nproc_per_node 2, gloo).

Usage: torchrun --nproc_per_node 2 make_fsdp_checkpoints.py OUT_ROOT

Each scenario builds a tiny Qwen2, shards it with fully_shard (per decoder layer, then the root),
takes optimizer steps so the weights differ from the initial model, and writes under
OUT_ROOT/<scenario>/:

* ``reference.pt``: the full state dict gathered with ``full_tensor()`` on rank 0 (the truth);
* ``rlctl/checkpoints/step_00000{1,2}/``: rlctl's layout (DCP + trainer_state.json + huggingface/
  [+ lora_adapter/]), ``checkpoints/latest`` naming step 2; the reference matches step 2;
* ``verl/global_step_{1,2}/actor/``: verl's layout (``model_world_size_2_rank_{r}.pt`` of DTensors,
  ``fsdp_config.json``, ``huggingface/`` [+ ``lora_adapter/``]), ``latest_checkpointed_iteration.txt``.

Scenarios: ``plain`` (untied, with a persistent buffer), ``tied`` (tied embeddings), ``hsdp``
((ddp, fsdp) = (2, 1) mesh, verl only), ``lora`` (peft LoRA r=4 alpha=8 on q/v) and ``rslora``
(rsLoRA with a rank_pattern and alpha_pattern, on q/k/v/o/gate).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from rlctl.testing import build_tiny_model


def build(root: Path, name: str, *, tied: bool, lora: dict | None, buffer: bool):
    from transformers import AutoModelForCausalLM

    hf_dir = root / name / "init"
    if dist.get_rank() == 0:
        build_tiny_model(hf_dir, seed=1, tie_word_embeddings=tied)
    dist.barrier()
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    if buffer:
        # A persistent buffer with an odd length: it must be copied once, never concatenated.
        model.model.norm.register_buffer("calib", torch.arange(5, dtype=torch.float32) + 0.5)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))
    return model, hf_dir


def shard(model, mesh) -> None:
    layers = model.base_model.model.model.layers if hasattr(model, "peft_config") else model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def train_step(model, opt, vocab: int) -> None:
    torch.manual_seed(100 + dist.get_rank())
    ids = torch.randint(0, vocab, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()


def save_meta(hf_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            (dest / f.name).write_bytes(f.read_bytes())


def save_adapter(model, dest: Path, with_weights: bool) -> None:
    """peft's adapter_config.json (and adapter_model.safetensors for verl) on rank 0."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if dist.get_rank() != 0:
        return
    dest.mkdir(parents=True, exist_ok=True)
    model.peft_config["default"].save_pretrained(str(dest))
    if with_weights:
        adapter = get_peft_model_state_dict(model, state_dict=full)
        save_file({k: v.contiguous() for k, v in adapter.items()}, dest / "adapter_model.safetensors")


def save_rlctl(model, opt, root: Path, step: int, hf_dir: Path, lora: bool) -> None:
    ckpt = root / "rlctl" / "checkpoints" / f"step_{step:06d}"
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=str(ckpt))
    if lora:
        save_adapter(model, ckpt / "lora_adapter", with_weights=False)
    if dist.get_rank() == 0:
        save_meta(hf_dir, ckpt / "huggingface")
        lora_info = {"rank": 4} if lora else None
        trainer = {"step": step, "epoch": 0, "world_size": 2, "method": "sft", "lora": lora_info}
        (ckpt / "trainer_state.json").write_text(json.dumps(trainer))
        (ckpt.parent / "latest").write_text(ckpt.name)
    dist.barrier()


def save_verl(model, root: Path, step: int, hf_dir: Path, lora: bool) -> None:
    actor = root / "verl" / f"global_step_{step}" / "actor"
    actor.mkdir(parents=True, exist_ok=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save(model.state_dict(), actor / f"model_world_size_{world}_rank_{rank}.pt")
    if lora:
        save_adapter(model, actor / "lora_adapter", with_weights=True)
    if rank == 0:
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
        save_meta(hf_dir, actor / "huggingface")
        (root / "verl" / "latest_checkpointed_iteration.txt").write_text(str(step))
    dist.barrier()


def save_reference(model, root: Path) -> None:
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in full.items()}, root / "reference.pt")
    dist.barrier()


def scenario(root: Path, name: str, *, mesh, tied=False, lora=None, buffer=False, rlctl=True) -> None:
    model, hf_dir = build(root, name, tied=tied, lora=lora, buffer=buffer)
    shard(model, mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-2)
    vocab = model.config.vocab_size
    out = root / name
    for step in (1, 2):
        train_step(model, opt, vocab)
        if rlctl:
            save_rlctl(model, opt, out, step, hf_dir, lora is not None)
        save_verl(model, out, step, hf_dir, lora is not None)
    save_reference(model, out)


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    scenario(root, "plain", mesh=mesh, buffer=True)
    scenario(root, "tied", mesh=mesh, tied=True)
    hsdp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ddp", "fsdp"))
    scenario(root, "hsdp", mesh=hsdp, rlctl=False)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    scenario(root, "lora", mesh=mesh, lora=lora)
    rslora = {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"],
        "rank_pattern": {"gate_proj": 2},
        "alpha_pattern": {"o_proj": 16},
    }
    scenario(root, "rslora", mesh=mesh, lora=rslora)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
