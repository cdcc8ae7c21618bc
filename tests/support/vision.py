"""Images and rows for the vision-language tests: solid-colour pictures, verl's geo3k layout, HF chat rows."""

from __future__ import annotations

import io
import random

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}


def png_bytes(colour: str = "red", size: tuple[int, int] = (56, 56), *, second: str | None = None) -> bytes:
    """A PNG of ``size`` filled with ``colour`` (its right third with ``second``, when given)."""
    from PIL import Image

    image = Image.new("RGB", size, COLOURS[colour])
    if second:
        w, h = size
        image.paste(Image.new("RGB", (w // 3, h), COLOURS[second]), (w - w // 3, 0))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def geo3k_row(i: int, colour: str, *, size=(56, 56)) -> dict:
    """A row exactly as verl's examples/data_preprocess/geo3k.py writes it (datasets' Image feature stores
    each image as {"bytes", "path"}; the problem text starts with <image>)."""
    problem = "<image>Which colour fills more of the image?"
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": "user", "content": problem + " Answer with one word."}],
        "images": [{"bytes": png_bytes(colour, size), "path": None}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": colour},
        "extra_info": {"split": "train", "index": i, "answer": colour, "question": problem},
    }


def chat_row(colour: str, *, size=(56, 56), inline: bool = False) -> dict:
    """An HF chat row: an image content part in the user turn, the image in the row's images column (or,
    ``inline``, inside the part itself as bytes)."""
    part = {"type": "image", "image": png_bytes(colour, size)} if inline else {"type": "image"}
    row = {
        "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "Which colour is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": f"It is {colour}."}]},
        ]
    }
    if not inline:
        row["images"] = [{"bytes": png_bytes(colour, size), "path": None}]
    return row


def chat_rows(n: int, *, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [chat_row(rng.choice(["red", "blue"]), size=rng.choice([(56, 56), (84, 56), (56, 112)])) for _ in range(n)]


def write_parquet(path, rows: list[dict]):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path
