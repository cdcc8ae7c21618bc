"""Load rlctl Megatron shards into a real megatron-core GPTModel on CPU, run it, save a dist checkpoint.

Run once per rank (``python mcore_save.py ...`` for one rank, ``torchrun --nproc-per-node N`` for more;
the world size must be tp * pp of the shards). For each ``--model SHARDS OUT``, per rank, it:

1. builds a ``GPTModel`` (local, non-Transformer-Engine layer spec) whose config is derived here from the
   HF config, by hand and independently of rlctl;
2. loads the rank's ``mp_rank_*/model.safetensors`` with ``load_state_dict`` and fails unless every
   parameter is set and no tensor is left over;
3. with ``--tokens`` and pp == 1: runs the model on the token ids and writes this TP rank's slice of the
   vocab-parallel logits to ``OUT/logits_tp{rank}.pt`` (the test compares them with HF's logits);
4. saves the model with ``megatron.core.dist_checkpointing`` (torch_dist) to ``OUT/dist`` and, with
   ``--singleton``, a second copy with the ``singleton_local_shards`` layout to ``OUT/dist_singleton``.

megatron-core's torch_dist writer assumes CUDA: ``torch.cuda.synchronize`` and
``torch.cuda.current_device`` are replaced so that it runs on CPU under gloo, and ``Tensor.cuda``
(used to sync the last stage's copy of tied embeddings) returns the tensor itself. Attention forks the CUDA
RNG tracker (for dropout, which is 0 here): the fork is replaced by a no-op.
"""

import argparse
import contextlib
import json
import math
import os
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.current_device = lambda: "cpu"
torch.Tensor.cuda = lambda self, *args, **kwargs: self  # tied embeddings + pp > 1 sync via .cuda()

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


class _NoRngTracker:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


tensor_parallel.get_cuda_rng_tracker = _NoRngTracker

# The local spec keeps the input / pre-MLP norms as modules of their own; the TE spec (the names of
# rlctl's shards and of dist checkpoints) fuses them into linear_qkv / linear_fc1.
LOCAL_SPEC_NAMES = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
}


def build_model(hf: dict, tp: int, pp: int) -> GPTModel:
    heads = hf["num_attention_heads"]
    qk_norm = hf["model_type"] == "qwen3"
    rope = hf.get("rope_parameters") or {}
    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_hidden_size=hf["intermediate_size"],
        normalization="RMSNorm",
        layernorm_epsilon=hf["rms_norm_eps"],
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf["model_type"] == "qwen2",
        qk_layernorm=qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
    )
    # Megatron-LM pads the vocabulary to a multiple of 128 * tp.
    padded_vocab = math.ceil(hf["vocab_size"] / (128 * tp)) * 128 * tp
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=qk_norm, normalization="RMSNorm"),
        vocab_size=padded_vocab,
        max_sequence_length=hf["max_position_embeddings"],
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=hf["tie_word_embeddings"],
        position_embedding_type="rope",
        rotary_base=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
    )


def convert_one(shards: Path, out: Path, tokens_file: Path | None, singleton: bool, tp: int, pp: int) -> None:
    meta = json.loads((shards / "rlctl_megatron.json").read_text())
    assert (meta["tp"], meta["pp"]) == (tp, pp), "all models of one run share tp and pp"
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()

    model = build_model(meta["hf_config"], tp, pp)
    state = load_file(shards / f"mp_rank_{tp_rank:02d}_{pp_rank:03d}" / "model.safetensors")
    for fused, local in LOCAL_SPEC_NAMES.items():
        state = {k.replace(fused, local): v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    assert not missing and not unexpected, f"rank {tp_rank},{pp_rank}: missing {missing} unexpected {unexpected}"

    if tokens_file is not None and pp == 1:
        model.eval()
        tokens = torch.load(tokens_file)
        seq = tokens.shape[1]
        positions = torch.arange(seq).expand_as(tokens)
        causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]  # True: hidden
        with torch.no_grad():
            logits = model(tokens, positions, attention_mask=causal_mask)
        torch.save(logits, out / f"logits_tp{tp_rank}.pt")

    layouts = [("dist", None)] + ([("dist_singleton", {"singleton_local_shards": True})] if singleton else [])
    for name, metadata in layouts:
        (out / name).mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(model.sharded_state_dict(metadata=metadata), str(out / name))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model",
        nargs=2,
        type=Path,
        action="append",
        required=True,
        metavar=("SHARDS", "OUT"),
        help="rlctl shards dir and output dir (repeatable)",
    )
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--tokens", type=Path)
    parser.add_argument("--singleton", action="store_true")
    args = parser.parse_args()

    store = f"file://{args.model[0][1].resolve()}/store"  # single-process runs (no torchrun)
    dist.init_process_group(
        "gloo",
        init_method=None if "RANK" in os.environ else store,
        rank=int(os.environ.get("RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    for shards, out in args.model:
        convert_one(shards, out, args.tokens, args.singleton, args.tp, args.pp)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
