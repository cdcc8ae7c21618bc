"""Shared-prefix micro-batches of a vision-language model: a group's images once, and the multimodal rope
positions a forward of each prompt and response alone would use."""

from __future__ import annotations

import pytest
import torch

from rlctl.engines.vision_prefix import shared_rope_position_ids
from rlctl.recipes.rl.batch import micro_batches
from tests.support.vlm_rl import vl_group_batch


@pytest.fixture(scope="module")
def vl_model_and_processor(tiny_vl_model_dir):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from rlctl.data.vision import load_processor

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vl_model_dir), dtype=torch.float32)
    return model, load_processor(str(tiny_vl_model_dir), AutoTokenizer.from_pretrained(tiny_vl_model_dir))


def test_shared_rows_carry_each_prompts_images_once_and_position_like_alone(vl_model_and_processor):
    model, vp = vl_model_and_processor
    batch = vl_group_batch(vp, 3, 3, width=5, seed=0)
    assert batch.prompts[0] == batch.prompts[3]  # same tokens, different pictures: still two groups
    cpu = torch.device("cpu")
    (shared,) = micro_batches(batch, list(range(9)), budget=10_000, pad_id=0, device=cpu, share_prefix=True)
    (packed,) = micro_batches(batch, list(range(9)), budget=10_000, pad_id=0, device=cpu, share_prefix=False)
    assert shared.input_ids.shape[0] == 3 and len(shared.image_grid_thw) == 3  # a group's image once
    assert len(packed.image_grid_thw) == 9  # each sample's prompt carries its image
    grids = [torch.as_tensor(p.image_grid_thw) for p in batch.meta[::3]]
    assert torch.equal(shared.image_grid_thw, torch.cat(grids))
    pos = shared_rope_position_ids(model, shared)
    checked = 0
    for row in range(3):
        members = [i for i in range(3 * row, 3 * row + 3) if len(batch.responses[i]) > 1]  # the others add no columns
        blocks = [b for b in shared.blocks if b[0] == row and b[4] > 0]  # (row, start, end, 0, P): the responses
        for i, (_, start, end, _, length) in zip(members, blocks, strict=True):
            alone = torch.tensor([batch.prompts[i] + batch.responses[i][:-1]])
            types = (alone == model.config.image_token_id).int()
            grid = torch.as_tensor(batch.meta[i].image_grid_thw)
            ref, _ = model.model.get_rope_index(alone, mm_token_type_ids=types, image_grid_thw=grid)
            assert torch.equal(pos[:, row, :length], ref[:, 0, :length])  # the prompt
            assert torch.equal(pos[:, row, start:end], ref[:, 0, length:])  # this response, after the prompt
            checked += 1
    assert checked >= 5
