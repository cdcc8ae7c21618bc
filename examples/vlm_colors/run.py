"""A tiny vision-language model learns which colour fills more of a picture, on CPU: SFT on an imperfect
teacher's answers, then GRPO with the task's reward; held-out accuracy before and after, as ``make demo``.

``python examples/vlm_colors/run.py [--out runs/vlm_colors] [--nproc 2] [--seed 0] [--quick]``

1. A tiny random Qwen2-VL (a 2-block vision tower, a 2-layer text model; ``rlctl.testing.build_tiny_vl_model``)
   with its tokenizer and image processor, written the Hugging Face way.
2. The data (:mod:`colors`): pictures of red and blue squares; SFT rows answered by a teacher who names the
   colour of the first coloured square (right on about 80% of the pictures), RL rows in verl's geo3k layout
   with the true answers, and held-out pictures.
3. ``rlctl sft``, then held-out accuracy (greedy decoding through plain transformers, the image processor and
   ``generate``): the teacher's habit is learned, its mistakes with it.
4. ``rlctl grpo --reward examples/vlm_colors/colors.py`` (the hf rollout engine with the images): sampled
   answers that are right earn the reward.
5. Held-out accuracy again: all pictures, those where the teacher is right, those where it is wrong.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import colors  # noqa: E402


@dataclass(frozen=True)
class Size:
    n_sft: int
    n_rl: int
    n_heldout: int
    sft_steps: int
    sft_batch: int
    sft_lr: float
    grpo_steps: int
    grpo_batch: int
    grpo_n: int
    grpo_lr: float


FULL = Size(400, 256, 200, 60, 32, 3e-3, 30, 16, 8, 5e-4)
QUICK = Size(32, 16, 16, 4, 8, 3e-3, 2, 4, 4, 5e-4)


def write_data(out: Path, size: Size, seed: int) -> list[colors.Picture]:
    """sft.parquet (the teacher's answers), rl.parquet (true answers, verl's layout); the held-out pictures."""
    pictures = colors.make_pictures(size.n_sft + size.n_rl + size.n_heldout, seed=seed)
    sft, rl = pictures[: size.n_sft], pictures[size.n_sft : size.n_sft + size.n_rl]
    colors.write_sft_parquet(out / "sft.parquet", sft, teacher=True)
    colors.write_rl_parquet(out / "rl.parquet", rl)
    return pictures[size.n_sft + size.n_rl :]


def answers(model_dir: Path, pictures: list[colors.Picture]) -> list[str]:
    """Greedy answers of the model in ``model_dir`` through plain transformers (its own image processor)."""
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from rlctl.testing import vl_greedy_answer

    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    processor = AutoImageProcessor.from_pretrained(str(model_dir))
    return [vl_greedy_answer(model, tok, processor, p.png(), colors.QUESTION, max_new_tokens=4)[0] for p in pictures]


def accuracy(model_dir: Path, pictures: list[colors.Picture]) -> dict[str, float]:
    """Held-out accuracy: all pictures, those the teacher answers right, those it answers wrong."""
    said = answers(model_dir, pictures)
    right = [colors.compute_score(colors.DATA_SOURCE, a, p.answer) for a, p in zip(said, pictures)]

    def share(keep) -> float:
        chosen = [r for r, p in zip(right, pictures) if keep(p)]
        return sum(chosen) / max(1, len(chosen))

    return {
        "all": share(lambda p: True),
        "teacher right": share(lambda p: colors.teacher_answer(p) == p.answer),
        "teacher wrong": share(lambda p: colors.teacher_answer(p) != p.answer),
    }


def rlctl(method: str, *args: str) -> None:
    print(f"$ rlctl {method} {' '.join(args)}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    code = subprocess.call([sys.executable, "-m", "rlctl", method, *args], env=env)
    if code:
        raise SystemExit(f"rlctl {method} failed (exit {code})")


def common(model: Path, data: Path, out: Path, nproc: int, seed: int, device: str) -> list[str]:
    return [
        *("--model", str(model), "--data", str(data), "--output-dir", str(out), "--device", device),
        *("--nproc", str(nproc), "--seed", str(seed)),
    ]


def run(out: Path, size: Size, nproc: int, seed: int, device: str = "cpu") -> dict:
    from rlctl.testing import build_tiny_vl_model

    prepare_out(out)
    times = {}
    start = time.perf_counter()
    base = build_tiny_vl_model(out / "base", seed=seed)
    heldout = write_data(out, size, seed)
    sft = (
        *("--batch-size", str(size.sft_batch), "--max-steps", str(size.sft_steps), "--lr", str(size.sft_lr)),
        *("--max-len", "128"),
    )
    t = time.perf_counter()
    rlctl("sft", *common(base, out / "sft.parquet", out / "sft", nproc, seed, device), *sft)
    times["sft"] = time.perf_counter() - t
    before = accuracy(out / "sft" / "hf", heldout)
    print(f"after SFT: {_line(before)}", flush=True)
    grpo = (
        *("--batch-size", str(size.grpo_batch), "--n", str(size.grpo_n), "--max-steps", str(size.grpo_steps)),
        *("--lr", str(size.grpo_lr), "--max-prompt-len", "128", "--max-response-len", "4", "--rollout", "hf"),
        *("--reward", str(HERE / "colors.py"), "--temperature", "1.0"),
    )
    t = time.perf_counter()
    rlctl("grpo", *common(out / "sft" / "hf", out / "rl.parquet", out / "grpo", nproc, seed, device), *grpo)
    times["grpo"] = time.perf_counter() - t
    after = accuracy(out / "grpo" / "hf", heldout)
    times["total"] = time.perf_counter() - start
    _table(before, after, len(heldout))
    print("time: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()))
    return {"after_sft": before, "after_grpo": after, "seconds": times}


MARKER = ".vlm-colors-example"  # a directory holding this file was made by this script and may be replaced


def prepare_out(out: Path) -> None:
    """A fresh output directory; one this script made before is replaced, anything else is refused."""
    import shutil

    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise SystemExit(f"{out} exists and was not made by this example; pass another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("made by examples/vlm_colors/run.py\n")


def _line(acc: dict[str, float]) -> str:
    return ", ".join(f"{k} {100 * v:.1f}%" for k, v in acc.items())


def _table(before: dict[str, float], after: dict[str, float], n: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"held-out accuracy, {n} pictures (greedy decoding)")
    table.add_column("model")
    for col in before:
        table.add_column(col, justify="right")
    for name, acc in (("after SFT", before), ("after GRPO", after)):
        table.add_row(name, *(f"{100 * acc[k]:.1f}%" for k in acc))
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/vlm_colors"))
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few steps on a few pictures (a smoke test)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where rlctl trains (default: cpu)")
    args = parser.parse_args(argv)
    run(args.out, QUICK if args.quick else FULL, args.nproc, args.seed, args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
