"""Vision-language data: verl's image parquet layout and HF chat rows with image parts, processed by the
model's own image processor; bad images are bad rows."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.sft import sft_config
from tests.support.vision import chat_row, chat_rows, geo3k_row, png_bytes, write_parquet


@pytest.fixture(scope="module")
def vp(tiny_vl_model_dir):
    from transformers import AutoTokenizer

    from rlctl.data.vision import load_processor

    return load_processor(str(tiny_vl_model_dir), AutoTokenizer.from_pretrained(str(tiny_vl_model_dir)))


def _independent_pixels(tiny_vl_model_dir, colour, size):
    """The image processor run directly on the decoded PNG: what the row's pixels must be."""
    import io

    from PIL import Image
    from transformers import AutoImageProcessor

    image = Image.open(io.BytesIO(png_bytes(colour, size))).convert("RGB")
    out = AutoImageProcessor.from_pretrained(str(tiny_vl_model_dir))(images=[image], return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def test_chat_rows_with_image_parts_expand_one_token_per_merged_patch(vp, tiny_vl_model_dir, tmp_path):
    from rlctl.data.sft import build_sft_data

    rows = [chat_row("red", size=(84, 56)), chat_row("blue", size=(56, 56), inline=True)]
    data = build_sft_data(
        sft_config(tiny_vl_model_dir, write_parquet(tmp_path / "d.parquet", rows), tmp_path / "r"),
        vp.tokenizer,
        vision=vp,
    )
    assert data.report.num_bad == 0 and len(data.train) == 2
    tok = vp.tokenizer
    for ex, (colour, size) in zip(data.train, [("red", (84, 56)), ("blue", (56, 56))]):
        pixels, grid = _independent_pixels(tiny_vl_model_dir, colour, size)
        np.testing.assert_array_equal(ex.pixel_values, pixels)
        np.testing.assert_array_equal(ex.image_grid_thw, grid)
        ids = ex.input_ids.tolist()
        n = int(np.prod(grid[0])) // 4  # merge 2 x 2
        image_id = tok.convert_tokens_to_ids("<|image_pad|>")
        assert ids.count(image_id) == n
        start = ids.index(tok.convert_tokens_to_ids("<|vision_start|>"))
        assert ids[start + 1 : start + 1 + n] == [image_id] * n
        assert ids[start + 1 + n] == tok.convert_tokens_to_ids("<|vision_end|>")
        assert tok.decode(ex.labels[ex.labels != -100].tolist()) == f"It is {colour}.<|im_end|>\n"


def test_verl_geo3k_layout_with_image_placeholders(vp, tiny_vl_model_dir, tmp_path):
    """A parquet file with verl's geo3k fields (images as {"bytes", "path"}, <image> in the prompt text)
    trains SFT as prompt/response pairs unchanged; the image goes where <image> was."""
    from rlctl.data.sft import build_sft_data

    rows = [{**geo3k_row(i, c), "response": f"It is {c}."} for i, c in enumerate(["red", "blue", "red"])]
    path = write_parquet(tmp_path / "geo3k.parquet", rows)
    data = build_sft_data(sft_config(tiny_vl_model_dir, path, tmp_path / "r"), vp.tokenizer, vision=vp)
    assert len(data.train) == 3
    text = vp.tokenizer.decode(data.train[0].input_ids.tolist())
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    assert "<|vision_end|>Which colour fills more of the image?" in text and "<image>" not in text


def test_bad_images_are_bad_rows_counted_against_the_threshold(vp, tiny_vl_model_dir, tmp_path):
    from rlctl.data.sft import build_sft_data
    from rlctl.errors import UserError

    good = chat_rows(6)
    bad = [
        {**chat_row("red"), "images": [{"bytes": b"not an image", "path": None}]},
        {**chat_row("red"), "images": [{"bytes": None, "path": "missing.png"}]},
        {**chat_row("red"), "images": [{"bytes": png_bytes("red", (200, 100)), "path": None}]},
        {**chat_row("red"), "images": []},  # a placeholder without its image
    ]
    path = write_parquet(tmp_path / "d.parquet", good + bad)
    cfg = sft_config(tiny_vl_model_dir, path, tmp_path / "r", data__max_image_pixels=10000, data__max_bad_fraction=0.5)
    data = build_sft_data(cfg, vp.tokenizer, vision=vp)
    assert len(data.train) == 6 and data.report.num_bad == 4
    reasons = " | ".join(data.report.bad)
    for part in (
        "could not be decoded",
        "image file not found: missing.png",
        "200x100 pixels",
        "1 <image> placeholders but 0 images",
    ):
        assert part in reasons
    with pytest.raises(UserError, match="too many bad rows"):
        build_sft_data(
            sft_config(tiny_vl_model_dir, path, tmp_path / "r", data__max_image_pixels=10000), vp.tokenizer, vision=vp
        )


def test_image_paths_relative_to_the_data_file_and_text_models_refuse_images(
    vp, tiny_model_dir, tiny_vl_model_dir, tmp_path
):
    from transformers import AutoTokenizer

    from rlctl.data.sft import build_sft_data

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png_bytes("blue"))
    rows = [{**chat_row("blue"), "images": ["img/a.png"]}, {**chat_row("blue"), "images": []}]
    rows[1]["messages"][0]["content"] = [{"type": "text", "text": "No picture here.", "image": None}]
    path = write_parquet(tmp_path / "d.parquet", rows)
    data = build_sft_data(sft_config(tiny_vl_model_dir, path, tmp_path / "r"), vp.tokenizer, vision=vp)
    assert [ex.pixel_values is not None for ex in data.train] == [True, False]  # a text-only row is fine
    text_tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    cfg = sft_config(tiny_model_dir, path, tmp_path / "r2", data__max_bad_fraction=0.6)
    text_only = build_sft_data(cfg, text_tok)
    assert dict(text_only.report.bad) == {"images, but the model has no vision tower": 1}


def test_processed_images_are_cached_with_the_tokens(vp, tiny_vl_model_dir, tmp_path):
    from rlctl.data.sft import build_sft_data

    text_only = {**chat_row("red"), "images": []}
    text_only["messages"][0]["content"] = [{"type": "text", "text": "Say red.", "image": None}]
    bad = {**chat_row("red"), "images": [{"bytes": b"not an image", "path": None}]}
    rows = [text_only, *chat_rows(4), bad]  # a batch of the cache mixes rows with and without pixels
    path = write_parquet(tmp_path / "d.parquet", rows)
    cfg = sft_config(tiny_vl_model_dir, path, tmp_path / "r", data__max_bad_fraction=0.5)
    plain = build_sft_data(cfg, vp.tokenizer, vision=vp)
    assert len(plain.train) == 5 and plain.train[0].pixel_values is None
    for _ in range(2):  # the second call reads the cache file
        cached = build_sft_data(cfg, vp.tokenizer, vision=vp, cache_dir=tmp_path / "cache")
        for a, b in zip(plain.train, cached.train):
            np.testing.assert_array_equal(a.input_ids, b.input_ids)
            np.testing.assert_array_equal(a.pixel_values, b.pixel_values)
            np.testing.assert_array_equal(a.image_grid_thw, b.image_grid_thw)
    assert len(list((tmp_path / "cache").glob("sft-*.arrow"))) == 1


def test_a_vl_model_without_its_image_processor_fails_before_launch(tiny_vl_model_dir, tmp_path, monkeypatch, capsys):
    import shutil

    from tests.support.cli import one_line_error, rlctl_in_process

    model = tmp_path / "model"
    shutil.copytree(tiny_vl_model_dir, model)
    (model / "preprocessor_config.json").unlink()
    data = write_parquet(tmp_path / "d.parquet", chat_rows(2))
    args = ("sft", "--model", str(model), "--data", str(data), "--output-dir", str(tmp_path / "run"), "--dry-run")
    line = one_line_error(*rlctl_in_process(monkeypatch, capsys, *args))
    assert "vision-language model without preprocessor_config.json" in line
    shutil.copy(tiny_vl_model_dir / "preprocessor_config.json", model)
    code, text = rlctl_in_process(monkeypatch, capsys, *args)
    assert code == 0, text[-2000:]
    assert "vision tower" in text  # the plan counts it (rlctl.estimate)
    ppo = ("ppo", *args[1:])  # a VL model cannot be PPO's critic: refused by the plan, not on the ranks
    assert "use grpo" in one_line_error(*rlctl_in_process(monkeypatch, capsys, *ppo))
