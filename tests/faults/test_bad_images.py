"""An image too large is named as too large, not as undecodable (issue 37, item 3).

A 20000 x 20000 image is over PIL's decompression-bomb limit, which PIL raises before anyone reads the size;
the bad-row reason must name the size and ``data.max_image_pixels`` (the user resizes it, rather than looking
for a corrupt file). The image is a real PNG header (IHDR with its CRC) and a little pixel data: the size is
in the header, and decoding 400 M pixels is what the check exists to avoid.
"""

from __future__ import annotations

import struct
import zlib

import pytest

from tests.support.sft import sft_config
from tests.support.vision import chat_row, chat_rows, write_parquet


def png_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def vp(tiny_vl_model_dir):
    from transformers import AutoTokenizer

    from rlctl.data.vision import load_processor

    return load_processor(str(tiny_vl_model_dir), AutoTokenizer.from_pretrained(str(tiny_vl_model_dir)))


def test_a_20000_square_image_is_a_bad_row_for_its_size(vp, tiny_vl_model_dir, tmp_path):
    from rlctl.data.sft import build_sft_data

    huge = {**chat_row("red"), "images": [{"bytes": png_header(20000, 20000), "path": None}]}
    path = write_parquet(tmp_path / "d.parquet", chat_rows(6) + [huge])
    cfg = sft_config(tiny_vl_model_dir, path, tmp_path / "r", data__max_bad_fraction=0.5)
    data = build_sft_data(cfg, vp.tokenizer, vision=vp)
    assert data.report.num_bad == 1, data.report.bad
    (reason,) = data.report.bad
    assert "20000x20000 pixels, more than data.max_image_pixels=16777216" in reason, reason
    assert "decoded" not in reason


def test_without_rlctl_s_limit_pils_limit_is_named(tmp_path):
    from rlctl.data.vision import BadImage, decode_image

    with pytest.raises(BadImage, match="decompression-bomb limit"):
        decode_image(png_header(20000, 20000), max_pixels=0)
    with pytest.raises(BadImage, match="could not be decoded"):
        decode_image(b"\x89PNG\r\n\x1a\nnot really", max_pixels=0)
