"""The synthetic image task of examples/vlm_colors: verl's geo3k layout, pictures whose pixels agree with the
answer, the reward through rlctl's reward loader."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlctl.rewards.loader import get_reward

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vlm_colors"
sys.path.insert(0, str(EXAMPLE))
import colors  # noqa: E402

PIL = pytest.importorskip("PIL.Image")


def pixel_counts(png: bytes) -> dict[str, int]:
    """Pixels nearer red, blue or white, counted on the decoded image (independent of the generator's cells)."""
    image = PIL.open(io.BytesIO(png)).convert("RGB")
    counts = {"red": 0, "blue": 0, "white": 0}
    refs = {"red": (255, 0, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}
    data = image.tobytes()
    for rgb in zip(data[0::3], data[1::3], data[2::3]):
        nearest = min(refs, key=lambda k: sum((a - b) ** 2 for a, b in zip(rgb, refs[k])))
        counts[nearest] += 1
    return counts


def test_rl_parquet_is_verls_geo3k_layout_and_the_pixels_agree(tmp_path):
    pictures = colors.make_pictures(12, seed=3)
    path = colors.write_rl_parquet(tmp_path / "train.parquet", pictures)
    table = pq.read_table(path)
    assert table.column_names == ["data_source", "prompt", "images", "ability", "reward_model", "extra_info"]
    rows = table.to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows].count("red") == 6  # balanced
    for i, row in enumerate(rows):
        assert row["data_source"] == "vlm_colors" and row["reward_model"]["style"] == "rule"
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"].startswith("<image>")
        assert message["content"].count("<image>") == len(row["images"]) == 1
        assert row["extra_info"] == {
            "split": "train",
            "index": i,
            "answer": row["reward_model"]["ground_truth"],
            "question": message["content"],
        }
        png = row["images"][0]["bytes"]
        assert png.startswith(b"\x89PNG") and row["images"][0]["path"] is None
        counts = pixel_counts(png)
        assert PIL.open(io.BytesIO(png)).size == (56, 56)
        assert counts["red"] != counts["blue"]
        assert row["reward_model"]["ground_truth"] == max(("red", "blue"), key=counts.get)


def test_sft_rows_carry_the_image_and_the_teachers_answer(tmp_path):
    pictures = colors.make_pictures(200, seed=4)
    rows = pq.read_table(colors.write_sft_parquet(tmp_path / "sft.parquet", pictures)).to_pylist()
    user, assistant = rows[0]["messages"]
    assert user["content"][0]["type"] == "image" and assistant["role"] == "assistant"
    assert len(rows[0]["images"]) == 1
    answers = [r["messages"][1]["content"][0]["text"] for r in rows]
    right = sum(a == p.answer for a, p in zip(answers, pictures)) / len(pictures)
    assert 0.65 < right < 0.95  # the teacher's habit: right on most pictures, not all


def test_reward_through_rlctls_loader():
    score = get_reward(f"{EXAMPLE / 'colors.py'}:compute_score")
    assert score("vlm_colors", "red", "red") == 1.0
    assert score("vlm_colors", " Red.", "red") == 1.0
    assert score("vlm_colors", "blue", "red") == 0.0
    assert score("vlm_colors", "red or blue", "red") == 0.0
