"""`rlctl bench convert CKPT`: throughput and peak RSS of ``fsdp-to-hf`` beside a plain copy.

Each measurement runs in a fresh process (its peak RSS is the kernel's ``ru_maxrss``):

* ``copy``: ``shutil.copyfile`` of the checkpoint's weight files (sendfile, in the kernel) and a
  copy through user space (read + write in 16 MiB blocks, what any converter touching the bytes
  pays at least): the I/O limit of this disk;
* ``baseline``: a process that only imports what a conversion imports;
* ``convert``: :func:`rlctl.convert.pipeline.fsdp_to_hf` without verification (``verify`` with it,
  on request), timed after the imports.

Rates: the copies over the weight files' bytes; the conversions over the model tensors' bytes
(for an rlctl DCP checkpoint the files also hold the optimizer states, which a conversion skips;
for a verl checkpoint the two are the same). The page cache is not dropped: copy and convert read
equally warm (or cold) data, and whichever runs first may warm it, so the copy runs first.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from rlctl.bench.common import run_measured, stdout_value

# What a conversion imports anyway: the baseline process loads these and nothing else, and the
# timed conversions load them before the clock starts.
IMPORTS = (
    "import rlctl.convert.pipeline\n"
    "import torch.distributed.tensor, torch.distributed.checkpoint\n"
    "from transformers import AutoModelForCausalLM\n"
)


def weight_files(weights_dir: Path) -> list[Path]:
    """The files of a checkpoint's weights directory (not its huggingface/ or adapter subdirs)."""
    return sorted(f for f in weights_dir.iterdir() if f.is_file())


def tensor_bytes(source) -> tuple[int, int]:
    """(bytes of all model tensors, bytes of the largest) of a :class:`rlctl.convert.sources.TensorSource`."""
    import math

    sizes = [math.prod(source.shape(k)) * source.dtype(k).itemsize for k in source.keys()]
    return sum(sizes), max(sizes, default=0)


def measure_copies(files: list[Path], dest: Path) -> dict:
    """Seconds to copy ``files`` into ``dest``, in the kernel and through user space."""
    total = sum(f.stat().st_size for f in files)
    out = {}
    for label, line in (
        ("copy", "shutil.copyfile({src!r}, {dst!r})\n"),
        ("user_copy", "with open({src!r}, 'rb') as a, open({dst!r}, 'wb') as b: shutil.copyfileobj(a, b, 16 << 20)\n"),
    ):
        code = (
            f"import shutil, os, time\nos.makedirs({str(dest)!r})\nt = time.perf_counter()\n"
            + "".join(line.format(src=str(f), dst=str(dest / f.name)) for f in files)
            + "print('ELAPSED', time.perf_counter() - t)"
        )
        _, _, stdout = run_measured(code)
        seconds = stdout_value(stdout, "ELAPSED")
        out.update({f"{label}_s": seconds, f"{label}_gbps": total / seconds / 1e9})
        shutil.rmtree(dest)
    return out


def measure_conversion(path: Path, out: Path, *, verify: bool, baseline_rss: int, model_bytes: int, label: str) -> dict:
    code = (
        IMPORTS + "import time\nfrom rlctl.convert.pipeline import fsdp_to_hf\nt = time.perf_counter()\n"
        f"r = fsdp_to_hf({str(path)!r}, {str(out)!r}, verify={verify})\n"
        "assert r.committed\nprint('ELAPSED', time.perf_counter() - t)"
    )
    _, rss, stdout = run_measured(code)
    seconds = stdout_value(stdout, "ELAPSED")
    shutil.rmtree(out, ignore_errors=True)
    return {
        f"{label}_s": seconds,
        f"{label}_gbps": model_bytes / seconds / 1e9,
        f"{label}_peak_rss": rss,
        f"{label}_rss_over_baseline": rss - baseline_rss,
    }


def bench_convert(path: str | Path, *, verify: bool = False, work: str | Path | None = None) -> dict:
    """Measure copy, baseline and conversion of the checkpoint at ``path`` (step, actor or run dir)."""
    from rlctl.convert.locate import locate_checkpoint

    ckpt = locate_checkpoint(path)
    files = weight_files(ckpt.weights_dir)
    model_bytes, largest = tensor_bytes(ckpt.open())
    scratch = Path(tempfile.mkdtemp(prefix="rlctl-bench-convert-", dir=work))
    try:
        result = {
            "checkpoint": str(ckpt.weights_dir),
            "format": ckpt.format,
            "world_size": ckpt.world_size,
            "files": len(files),
            "checkpoint_bytes": sum(f.stat().st_size for f in files),
            "model_bytes": model_bytes,
            "tensors_largest_bytes": largest,
        }
        result.update(measure_copies(files, scratch / "copy"))
        base_s, base_rss, _ = run_measured(IMPORTS)
        result.update({"baseline_rss": base_rss, "baseline_s": base_s})
        for label, check in [("convert", False)] + ([("verify", True)] if verify else []):
            result.update(
                measure_conversion(
                    ckpt.weights_dir,
                    scratch / f"hf-{label}",
                    verify=check,
                    baseline_rss=base_rss,
                    model_bytes=model_bytes,
                    label=label,
                )
            )
        result["convert_vs_copy"] = result["convert_gbps"] / result["user_copy_gbps"]
        return result
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
