"""Training metrics: RUN/metrics.jsonl and a console line always; TensorBoard and W&B on request.

One JSON object per line. Training records carry at least ``step``, ``total_steps``, ``loss`` (or
``reward`` for RL), ``lr``, ``grad_norm``, ``tokens_per_s`` and ``time/step`` (seconds); eval
records carry ``step`` and ``val_loss`` and ``"kind": "eval"``. The launcher tails this file for its
progress bar. TensorBoard and W&B are imported only when ``log.backends`` names them.

Non-finite values: JSON has no NaN or infinity, so metrics.jsonl writes them as ``null`` and lists
their keys under ``"nonfinite": {"loss": "nan"}`` (read_metrics turns them back into float NaN/inf);
TensorBoard, W&B and the console get the real float (a NaN loss shows as nan on the curves).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from rlctl.errors import UserError, did_you_mean
from rlctl.names import LogBackend, choices

BACKENDS = choices(LogBackend)


def parse_backends(spec: str) -> list[str]:
    """'console,tensorboard' -> ['console', 'tensorboard'] (unknown names are a UserError)."""
    names = [s.strip().lower() for s in (spec or "").split(",") if s.strip()]
    for name in names:
        if name not in BACKENDS:
            raise UserError(f"unknown log backend '{name}'{did_you_mean(name, BACKENDS)}; use {', '.join(BACKENDS)}")
    return names


def check_backends_installed(spec: str) -> None:
    """Fail early (before launching) when a requested backend's package is missing."""
    import importlib.util

    packages = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for name in parse_backends(spec):
        pkg = packages.get(name)
        if pkg and importlib.util.find_spec(pkg) is None:
            raise UserError(f"--log {name} needs the `{pkg}` package: pip install {pkg}")


def format_record(record: dict) -> str:
    """A compact console line: 'step 3/10 | loss 2.3145 | lr 1.00e-05 | ...'."""
    parts = []
    if "step" in record:
        total = record.get("total_steps")
        parts.append(f"step {record['step']}/{total}" if total else f"step {record['step']}")
    for key, value in record.items():
        if key in ("step", "total_steps", "kind", "time"):
            continue
        if isinstance(value, float):
            text = f"{value:.2e}" if key == "lr" or (value != 0 and abs(value) < 1e-3) else f"{value:.4g}"
        else:
            text = str(value)
        parts.append(f"{key} {text}")
    return " | ".join(parts)


class MetricsLogger:
    """Writes records on the main rank only (other ranks get a no-op logger)."""

    def __init__(
        self,
        path: str | Path,
        *,
        backends: str = "console",
        enabled: bool = True,
        project: str = "rlctl",
        run_name: str = "",
        config: dict | None = None,
    ):
        self.enabled = enabled
        self.names = parse_backends(backends)
        self._file = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (line-buffered, open for the run; the launcher tails it)
        if "tensorboard" in self.names:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError("--log tensorboard needs the `tensorboard` package: pip install tensorboard") from None
            self._tb = SummaryWriter(log_dir=str(path.parent / "tensorboard"))
        if "wandb" in self.names:
            try:
                import wandb
            except ImportError:
                raise UserError("--log wandb needs the `wandb` package: pip install wandb") from None
            self._wandb = wandb.init(
                project=project, name=run_name or path.parent.name, config=config or {}, dir=str(path.parent)
            )

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {k: _plain(v) for k, v in record.items()}
        record.setdefault("time", round(time.time(), 3))
        self._file.write(json.dumps(to_json(record)) + "\n")
        if "console" in self.names:
            print(format_record(record), flush=True)
        step = record.get("step", 0)
        scalars = {
            k: float(v)
            for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")
        }
        prefix = "eval/" if record.get("kind") == "eval" else "train/"
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(prefix + k, v, step)
        if self._wandb is not None:
            self._wandb.log({prefix + k: v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _plain(v):
    """A tensor or numpy scalar as a Python number; everything else unchanged."""
    return v.item() if hasattr(v, "item") else v


def to_json(record: dict) -> dict:
    """``record`` as JSON can hold it: a NaN or infinite float becomes null, its kind listed under
    ``"nonfinite"`` ({"loss": "nan"}); see :func:`from_json`."""
    bad = {k: str(v) for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
    if not bad:
        return record
    return {**{k: (None if k in bad else v) for k, v in record.items()}, "nonfinite": bad}


def from_json(record: dict) -> dict:
    """The inverse of :func:`to_json`: the listed keys become float nan / inf / -inf again."""
    bad = record.pop("nonfinite", None)
    if isinstance(bad, dict):
        for k, text in bad.items():
            record[k] = float(text)
    return record


def read_metrics(path: str | Path) -> list[dict]:
    """All complete records of a metrics.jsonl (a half-written last line is ignored)."""
    p = Path(path)
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(from_json(json.loads(line)))
        except (json.JSONDecodeError, ValueError, TypeError, AttributeError):
            continue
    return out
