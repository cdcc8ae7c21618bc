"""Vision-language models (Qwen2-VL, Qwen2.5-VL) in the training engines: the vision tower, the LoRA targets,
and the inputs of a training forward.

A micro-batch of a VL model carries ``pixel_values`` ``[P, D]`` and ``image_grid_thw`` ``[I, 3]`` (its
documents' images, in the order of their image tokens; :func:`rlctl.data.packing.collate_packed`). The
forward gets exactly what generation gives the model: the same pixels, and multimodal rope position ids
``[3, B, T]`` (temporal, height, width) from the model's own ``get_rope_index``, computed per document
so that a packed row's documents each start at position 0 as they would alone. A packed row also passes
its per-document text positions first (``[4, B, T]``: transformers' packed format), from which the model
builds the block-diagonal attention mask.

FSDP2: the vision tower is one unit of its own (its blocks are small; one all-gather per forward). Every
rank must run it in every forward, images or not, at the same point, or the ranks' collectives diverge: a
micro-batch without images runs it on a one-patch dummy image whose output enters the input embeddings
times zero (:func:`dummy_tower`).

:class:`VisionAdapter` is how the FSDP engine builds and calls a VL model (``AutoModelForImageTextToText``):
the tower frozen unless ``--train-vision``, LoRA on the language model's linear layers, no per-document
attention through :mod:`rlctl.engines.varlen` (transformers' packed masks instead), shared-prefix rows
(GRPO) with their blocks' dense mask and positions (:mod:`rlctl.engines.vision_prefix`).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from rlctl.engines import varlen
from rlctl.engines.adapters import CallContext, ModelAdapter
from rlctl.engines.spec import LoraSpec
from rlctl.engines.vision_prefix import shared_rope_position_ids

VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")


def vision_tower(hf: nn.Module) -> nn.Module | None:
    """The vision encoder of a transformers VL model (``model.visual`` for Qwen2-VL), or None."""
    for holder in (getattr(hf, "model", None), hf):
        for name in VISION_TOWER_NAMES:
            tower = getattr(holder, name, None) if holder is not None else None
            if isinstance(tower, nn.Module):
                return tower
    return None


def language_linear_names(hf: nn.Module, *, with_vision: bool) -> list[str]:
    """Full names of the linear layers LoRA targets as "all-linear" on a VL model: the language model's
    (the lm_head excepted, as peft does), and the vision tower's too when it is trained."""
    tower = vision_tower(hf)
    inside = {id(m) for m in tower.modules()} if tower is not None else set()
    out = []
    for name, module in hf.named_modules():
        if not isinstance(module, nn.Linear) or name.endswith("lm_head"):
            continue
        if id(module) in inside and not with_vision:
            continue
        out.append(name)
    return out


def document_ranges(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``[B, T]`` text positions, the (start, end) of each document (a new one wherever the
    position restarts at 0)."""
    out = []
    for pos in position_ids.tolist():
        starts = [t for t, p in enumerate(pos) if p == 0 or t == 0]
        out.append(list(zip(starts, starts[1:] + [len(pos)])))
    return out


def rope_position_ids(model: nn.Module, input_ids, position_ids, attention_mask, image_grid_thw) -> torch.Tensor:
    """Multimodal rope positions ``[3, B, T]`` from the model's ``get_rope_index``, one document at a time
    (the images of ``image_grid_thw`` taken in order). Padded rows (``attention_mask``): per row."""
    inner = model.model
    image_id = model.config.image_token_id
    types = (input_ids == image_id).int()  # mm_token_type_ids: 1 for image tokens, 0 for text
    out = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
    grids = list(image_grid_thw) if image_grid_thw is not None else []
    k = 0
    ranges = (
        [[(0, input_ids.shape[1])] for _ in range(input_ids.shape[0])]
        if attention_mask is not None
        else document_ranges(position_ids)
    )
    for row, docs in enumerate(ranges):
        for start, end in docs:
            ids, typ = input_ids[row : row + 1, start:end], types[row : row + 1, start:end]
            n = _image_count(typ[0])
            grid = torch.stack(grids[k : k + n]) if n else None
            k += n
            mask = attention_mask[row : row + 1, start:end] if attention_mask is not None else None
            if grid is None:  # text only: the positions the model itself would use
                plain = position_ids[row, start:end] if mask is None else (mask[0].cumsum(-1) - 1).clamp(min=0)
                out[:, row, start:end] = plain
                continue
            pos, _ = inner.get_rope_index(ids, mm_token_type_ids=typ, image_grid_thw=grid, attention_mask=mask)
            out[:, row, start:end] = pos[:, 0]
    return out


def _image_count(types: torch.Tensor) -> int:
    """How many images a document holds: its runs of image tokens."""
    t = types.tolist()
    return sum(1 for j, v in enumerate(t) if v == 1 and (j == 0 or t[j - 1] == 0))


def dummy_image(config, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest image the vision tower takes (one merged patch: grid 1 x merge x merge), zeros."""
    vc = config.vision_config
    merge = int(getattr(vc, "spatial_merge_size", 2))
    patch = int(getattr(vc, "patch_size", 14))
    temporal = int(getattr(vc, "temporal_patch_size", 2))
    dim = int(getattr(vc, "in_channels", 3)) * temporal * patch * patch
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=device)
    return torch.zeros(merge * merge, dim, dtype=dtype, device=device), grid


def vision_kwargs(model: nn.Module, mb, *, packed_text: bool) -> dict:
    """The keyword arguments of a VL model's forward for micro-batch ``mb`` (see the module docstring)."""
    rope = rope_position_ids(model, mb.input_ids, mb.position_ids, mb.attention_mask, mb.image_grid_thw)
    position_ids = torch.cat([mb.position_ids[None], rope]) if packed_text else rope
    kwargs = {"position_ids": position_ids}
    if mb.pixel_values is not None:
        kwargs.update(pixel_values=mb.pixel_values, image_grid_thw=mb.image_grid_thw)
    return kwargs


def run_dummy_tower(model: nn.Module, tower: nn.Module) -> torch.Tensor:
    """Zero times the vision tower's output on :func:`dummy_image`."""
    param = next(tower.parameters())
    pixels, grid = dummy_image(model.config, param.device, torch.float32)
    out = tower(pixels.to(param.dtype), grid_thw=grid)
    features = out.pooler_output if hasattr(out, "pooler_output") else out
    return features.sum() * 0.0


@contextlib.contextmanager
def dummy_tower(model: nn.Module):
    """While a forward without images runs: the vision tower runs on :func:`dummy_image` where it would run
    with images (just before the language model), its output added times zero to the input embeddings. So
    every rank gathers the FSDP units in the same order, and a trained tower gets (zero) gradients everywhere."""
    tower = vision_tower(model)
    language = getattr(getattr(model, "model", None), "language_model", None)
    if tower is None or language is None:
        yield
        return

    def pre_hook(module, args, kwargs):
        if kwargs.get("inputs_embeds") is not None:
            kwargs["inputs_embeds"] = kwargs["inputs_embeds"] + run_dummy_tower(model, tower)
        return args, kwargs

    handle = language.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class VisionAdapter(ModelAdapter):
    """A vision-language model (actor or reference): its output is logits, its inputs carry images."""

    kind = "vision-language model"

    def auto_class(self):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText

    def finish(self, model: nn.Module, config, *, train_vision: bool, param_dtype, pretrained: bool) -> nn.Module:
        if not train_vision:
            vision_tower(model).requires_grad_(False)  # frozen unless --train-vision
        return model

    def lora_targets(self, model: nn.Module, lora: LoraSpec, *, train_vision: bool):
        if lora.target_modules == "all-linear":  # the language model's layers (the tower's when trained)
            return language_linear_names(model, with_vision=train_vision)
        return lora.target_modules

    def tower(self, hf: nn.Module) -> nn.Module | None:
        return vision_tower(hf)

    def varlen(self, attn: str) -> bool:
        return False  # transformers' packed masks from the text positions

    def shares_prefix(self, *, varlen: bool, attn: str) -> bool:
        return attn == "sdpa"  # the blocks' dense mask

    def forward_micro(self, root, mb, ctx: CallContext) -> torch.Tensor:
        """A VL model's logits for one micro-batch: its pixels and multimodal rope positions; packed rows give
        their text positions too, for per-document masks; shared-prefix rows their blocks' dense mask and
        positions (each group's prompt, its images too, once, then its responses)."""
        hf = self.hf_model(root)
        if mb.blocks is not None:
            kwargs = varlen.attention_kwargs(mb.blocks, mb.input_ids, split=False)
            kwargs["position_ids"] = shared_rope_position_ids(hf, mb)
            if mb.pixel_values is not None:
                kwargs.update(pixel_values=mb.pixel_values, image_grid_thw=mb.image_grid_thw)
        else:
            kwargs = vision_kwargs(hf, mb, packed_text=mb.attention_mask is None)
            kwargs["attention_mask"] = mb.attention_mask
        keep = mb.keep_cols if mb.keep_cols is not None else mb.logit_index
        if keep is not None:
            kwargs["logits_to_keep"] = keep
        dummy = mb.pixel_values is None and ctx.gather_everywhere  # every rank gathers the tower
        with ctx.memory(), dummy_tower(hf) if dummy else contextlib.nullcontext():
            return root(input_ids=mb.input_ids, use_cache=False, **kwargs).logits
