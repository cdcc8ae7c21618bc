"""A synthetic image task a tiny vision-language model can learn: which colour fills more of the picture?

A picture is a ``grid x grid`` board of ``cell``-pixel squares (by default 4 x 4 squares of 14 pixels: one
square per vision patch of Qwen2-VL); some squares are red, some blue, the rest white, with a little noise in
every colour so no two pictures are alike. Red and blue never tie. The question is always the same::

    <image>Which colour fills more of the image, red or blue? Answer with one word.

and the answer is ``red`` or ``blue``. :func:`write_rl_parquet` writes verl's geo3k layout unchanged
(``examples/data_preprocess/geo3k.py``: ``data_source``, a chat ``prompt`` whose text starts with ``<image>``,
an ``images`` column of ``{"bytes": PNG, "path": None}`` as datasets' Image feature stores them, ``ability``,
``reward_model.ground_truth``, ``extra_info``); :func:`write_sft_parquet` writes HF chat rows with an image
content part and the ``images`` column. :func:`teacher_answer` is an imperfect demonstrator (it names the colour
of the first coloured square, reading row by row: right on about 80% of the pictures), so SFT learns a habit
that GRPO's reward then corrects, as in ``make demo``.

:func:`compute_score` is the task's reward in verl's signature (``--reward examples/vlm_colors/colors.py``):
rlctl's ``exact`` rule (case, spaces and a final full stop ignored) on the response.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "vlm_colors"
QUESTION = "Which colour fills more of the image, red or blue? Answer with one word."
PROMPT = "<image>" + QUESTION  # verl's placeholder: the row's first image
COLOURS = {"red": (210, 40, 40), "blue": (40, 40, 210), "white": (245, 245, 245)}
NOISE = 25  # each square's channels move by up to this much


@dataclass(frozen=True)
class Picture:
    """A board: ``cells[i]`` is the colour of square i (row by row)."""

    cells: tuple[str, ...]
    grid: int = 4
    cell: int = 14
    seed: int = 0  # the colour noise

    @property
    def red(self) -> int:
        return self.cells.count("red")

    @property
    def blue(self) -> int:
        return self.cells.count("blue")

    @property
    def answer(self) -> str:
        return "red" if self.red > self.blue else "blue"

    @property
    def size(self) -> tuple[int, int]:
        return (self.grid * self.cell, self.grid * self.cell)

    def png(self) -> bytes:
        """The picture, PNG-encoded."""
        from PIL import Image

        rng = random.Random(self.seed)
        image = Image.new("RGB", self.size)
        for i, colour in enumerate(self.cells):
            rgb = tuple(min(255, max(0, c + rng.randint(-NOISE, NOISE))) for c in COLOURS[colour])
            x, y = (i % self.grid) * self.cell, (i // self.grid) * self.cell
            image.paste(Image.new("RGB", (self.cell, self.cell), rgb), (x, y))
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()


def make_pictures(n: int, *, seed: int = 0, grid: int = 4, cell: int = 14) -> list[Picture]:
    """``n`` boards with 3 to ``grid^2 - 2`` coloured squares, red and blue never equal, half of them red."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        coloured = rng.randint(3, grid * grid - 2)
        red = rng.randint(0, coloured)
        if 2 * red == coloured:
            continue
        cells = ["red"] * red + ["blue"] * (coloured - red) + ["white"] * (grid * grid - coloured)
        rng.shuffle(cells)
        picture = Picture(tuple(cells), grid, cell, rng.randrange(2**31))
        if (picture.answer == "red") == (len(out) % 2 == 0):  # alternate: half red, half blue
            out.append(picture)
    return out


def teacher_answer(p: Picture) -> str:
    """The colour of the first coloured square, reading row by row (a habit, right on most pictures)."""
    return next(c for c in p.cells if c != "white")


def rl_row(p: Picture, index: int, split: str) -> dict:
    """One row of verl's geo3k layout."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": PROMPT}],
        "images": [{"bytes": p.png(), "path": None}],
        "ability": "vision",
        "reward_model": {"style": "rule", "ground_truth": p.answer},
        "extra_info": {"split": split, "index": index, "answer": p.answer, "question": PROMPT},
    }


def sft_row(p: Picture, answer: str) -> dict:
    """An HF chat row: the image as a content part, the picture in the images column, ``answer`` as the reply."""
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ],
        "images": [{"bytes": p.png(), "path": None}],
    }


def write_rl_parquet(path: str | Path, pictures: list[Picture], split: str = "train") -> Path:
    return _write(path, [rl_row(p, i, split) for i, p in enumerate(pictures)])


def write_sft_parquet(path: str | Path, pictures: list[Picture], *, teacher: bool = True) -> Path:
    return _write(path, [sft_row(p, teacher_answer(p) if teacher else p.answer) for p in pictures])


def _write(path: str | Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """1.0 when the response is the right colour (rlctl's exact rule), else 0.0."""
    from rlctl.rewards.builtin import exact_score

    return exact_score(data_source, solution_str, ground_truth, extra_info)
