"""Weights of the Megatron engine: the GPTModel of a stage, loading its slices of the HF tensors, and
gathering full HF tensors back over TP and PP (:class:`StageGather`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from rlctl.engines.megatron.config import layer_spec, layout_config, rope
from rlctl.engines.megatron.parallel import layer_stages
from rlctl.formats.megatron_layout import MegatronLayoutConfig, megatron_shard_for_rank

_LOCAL_TO_LAYOUT = {
    ".input_layernorm.weight": ".self_attention.linear_qkv.layer_norm_weight",
    ".pre_mlp_layernorm.weight": ".mlp.linear_fc1.layer_norm_weight",
}


def build_gpt_model(hf: Mapping[str, Any], config, *, tp: int, cuda: bool):
    """This pipeline stage's ``GPTModel`` (parallel_state must be initialised)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from rlctl.formats.megatron_layout import padded_vocab_size

    layout = layout_config(hf, tp)
    theta, llama3_factor = rope(hf)
    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(hf, cuda=cuda, config=config),
        vocab_size=padded_vocab_size(layout, tp),
        max_sequence_length=int(hf.get("max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=theta,
        rope_scaling=llama3_factor is not None,
        rope_scaling_factor=llama3_factor or 8.0,
    )


def layout_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under the layout's names (local-spec norms renamed to the TE names)."""
    out = {}
    for name, p in model.named_parameters():
        for local, layout in _LOCAL_TO_LAYOUT.items():
            if name.endswith(local):
                name = name[: -len(local)] + layout
        out[name] = p
    return out


_LAYER0 = "decoder.layers.0."


def in_stage(name: str, local: int) -> str:
    """A one-layer stage's name (``decoder.layers.0.*``) as layer ``local`` of a real stage."""
    return f"decoder.layers.{local}." + name[len(_LAYER0) :] if name.startswith(_LAYER0) else name


def stage_shard(
    get_hf_tensor, layout: MegatronLayoutConfig, *, tp: int, pp: int, tp_rank: int, pp_rank: int
) -> dict[str, torch.Tensor]:
    """Rank ``(tp_rank, pp_rank)``'s Megatron state dict for any pipeline split (:func:`pipeline_stages`).

    The layout numbers even stages only, so each layer of this stage is read as the one layer of a
    stage of a ``pp = num_layers`` split and renumbered; layer 0 brings the embedding and the last
    layer the final norm and output layer, which are on the first and last stage in any split.
    """
    out: dict[str, torch.Tensor] = {}
    for layer, (stage, local) in enumerate(layer_stages(layout.num_layers, pp)):
        if stage == pp_rank:
            part = megatron_shard_for_rank(get_hf_tensor, layout, tp, layout.num_layers, tp_rank, layer)
            out.update((in_stage(name, local), t) for name, t in part.items())
    if layout.tied_embeddings and pp == 1:  # one stage: the output layer IS the embedding
        out.pop("output_layer.weight", None)
    return out


def load_hf_weights(
    model: torch.nn.Module, get_hf_tensor, layout: MegatronLayoutConfig, *, tp: int, pp: int, tp_rank: int, pp_rank: int
) -> None:
    """Copy rank ``(tp_rank, pp_rank)``'s slices of the HF tensors into ``model``; every parameter must be set."""
    shard = stage_shard(get_hf_tensor, layout, tp=tp, pp=pp, tp_rank=tp_rank, pp_rank=pp_rank)
    params = layout_state(model)
    missing, unexpected = sorted(set(params) - set(shard)), sorted(set(shard) - set(params))
    if missing or unexpected:
        raise RuntimeError(
            f"rank tp {tp_rank} pp {pp_rank}: the GPTModel and the weight layout disagree: "
            f"parameters without weights {missing[:4]}, weights without parameters {unexpected[:4]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            if tuple(p.shape) != tuple(shard[name].shape):
                raise RuntimeError(f"{name}: parameter {tuple(p.shape)} vs weights {tuple(shard[name].shape)}")
            p.copy_(shard[name])


class StageGather:
    """``(tp_rank, pp_rank, name) -> tensor`` for :func:`megatron_to_hf`, collective on every rank.

    The first request of a name gathers all its TP parts on its stage (all_gather) and broadcasts them
    to the other stages of the pipeline; later TP ranks of the same name come from that result.
    """

    def __init__(self, local: dict[str, torch.Tensor], tp: int, pp: int, device: torch.device, dtype: torch.dtype):
        from megatron.core import parallel_state

        self.local, self.tp, self.pp, self.device, self.dtype = local, tp, pp, device, dtype
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_ranks = dist.get_process_group_ranks(self.pp_group)
        self.key: tuple[int, str] | None = None
        self.parts: list[torch.Tensor] = []

    def __call__(self, tp_rank: int, pp_rank: int, name: str) -> torch.Tensor:
        if self.key != (pp_rank, name):
            self.key, self.parts = (pp_rank, name), self._gather(pp_rank, name)
        return self.parts[tp_rank]

    def _gather(self, pp_rank: int, name: str) -> list[torch.Tensor]:
        stacked = None
        if self.stage == pp_rank:
            mine = self.local[name].detach().to(self.device).contiguous()
            if self.tp > 1:
                joined = torch.empty((self.tp * mine.shape[0], *mine.shape[1:]), dtype=mine.dtype, device=self.device)
                dist.all_gather_into_tensor(joined, mine, group=self.tp_group)
                stacked = joined.view(self.tp, *mine.shape)
            else:
                stacked = mine[None]
        if self.pp > 1:
            header = torch.zeros(9, dtype=torch.long, device=self.device)
            if stacked is not None:
                header[0] = stacked.ndim
                header[1 : 1 + stacked.ndim] = torch.tensor(stacked.shape)
            src = self.pp_ranks[pp_rank]
            dist.broadcast(header, src=src, group=self.pp_group)
            if stacked is None:
                stacked = torch.empty(
                    tuple(header[1 : 1 + int(header[0])].tolist()), dtype=self.dtype, device=self.device
                )
            dist.broadcast(stacked, src=src, group=self.pp_group)
        return list(stacked.unbind(0))
