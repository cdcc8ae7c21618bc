"""RL prompts with images: verl's geo3k layout read unchanged, the images processed once (and cached), their
tokens expanded and counted in the prompt length, bad images as bad rows."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlctl.config import build_config
from rlctl.data.rl import build_rl_data
from rlctl.errors import UserError
from rlctl.presets import method_layers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "vlm_colors"))
import colors  # noqa: E402


def cfg_for(model_dir, path, **sections):
    layer = {"model": {"name": str(model_dir)}, "data": {"path": str(path), **sections.pop("data", {})}, **sections}
    return build_config("grpo", method_layers("grpo", None) + [layer])


@pytest.fixture(scope="module")
def vision(tiny_vl_model_dir):
    from transformers import AutoTokenizer

    from rlctl.data.vision import load_processor

    return load_processor(str(tiny_vl_model_dir), AutoTokenizer.from_pretrained(tiny_vl_model_dir))


def test_geo3k_layout_prompts_carry_their_processed_images(vision, tiny_vl_model_dir, tmp_path):
    pictures = colors.make_pictures(4, seed=2)
    rows = [colors.rl_row(p, i, "train") for i, p in enumerate(pictures)]
    rows[3]["images"] = [{"bytes": b"not a png", "path": None}]  # a bad image: a bad row
    path = tmp_path / "rl.parquet"
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    cfg = cfg_for(tiny_vl_model_dir, path, data={"max_bad_fraction": 0.5})
    data = build_rl_data(cfg, vision.tokenizer, cache_dir=tmp_path / "cache", vision=vision)
    assert len(data.train) == 3 and data.report.bad == {"an image could not be decoded": 1}
    image_id = vision.image_token_id
    for p, picture in zip(data.train, pictures):
        pixels, grid = vision.process([colors_image(picture)])
        np.testing.assert_array_equal(p.pixel_values, pixels)  # the image processor's own output
        np.testing.assert_array_equal(p.image_grid_thw, grid)
        assert p.token_ids.count(image_id) == int(np.prod(grid)) // 4 == 4  # 56 x 56: 2 x 2 merged patches
        assert p.ground_truth == picture.answer and p.data_source == "vlm_colors"
    again = build_rl_data(cfg, vision.tokenizer, cache_dir=tmp_path / "cache", vision=vision)  # from the cache
    np.testing.assert_array_equal(again.train[1].pixel_values, data.train[1].pixel_values)
    assert [p.token_ids for p in again.train] == [p.token_ids for p in data.train]


def test_image_tokens_count_in_the_prompt_length_and_text_models_refuse_images(
    vision, tiny_vl_model_dir, tiny_model_dir, tmp_path
):
    path = colors.write_rl_parquet(tmp_path / "rl.parquet", colors.make_pictures(2, seed=2))
    text_len = len(build_rl_data(cfg_for(tiny_vl_model_dir, path), vision.tokenizer, vision=vision).train[0].token_ids)
    short = cfg_for(tiny_vl_model_dir, path, rollout={"max_prompt_len": text_len - 1})
    with pytest.raises(UserError, match="no usable prompts"):
        build_rl_data(short, vision.tokenizer, vision=vision)
    with pytest.raises(UserError, match="too many bad rows"):  # every row: "images, but the model has no vision tower"
        build_rl_data(cfg_for(tiny_model_dir, path), vision.tokenizer)


def colors_image(picture):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(picture.png())).convert("RGB")
