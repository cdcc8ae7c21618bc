"""Reading rows from JSONL, JSON, Parquet, or a `datasets` directory saved with ``save_to_disk``.

Every reader returns plain Python dicts. A JSONL line that is not a JSON object is not fatal: it is
reported in :attr:`Rows.unreadable` so the caller can count it as a bad row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.errors import UserError

FORMATS_HELP = "JSONL (.jsonl), JSON (.json), Parquet (.parquet) or a `datasets` directory (save_to_disk)"


@dataclass
class Rows:
    rows: list[dict]
    unreadable: list[str] = field(default_factory=list)  # one reason per line that could not be parsed

    def __len__(self) -> int:
        return len(self.rows) + len(self.unreadable)


def read_rows(path: str | Path, *, split: str = "train") -> Rows:
    """Read every row of a data file or `datasets` directory (``split`` picks from a DatasetDict)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"data not found: {p} (pass {FORMATS_HELP})")
    if p.is_dir():
        return Rows(_read_datasets_dir(p, split))
    suffix = "".join(p.suffixes[-2:]) if p.suffix == ".gz" else p.suffix
    if suffix in (".jsonl", ".jsonl.gz", ".ndjson"):
        return _read_jsonl(p)
    if suffix == ".json":
        return _read_json(p)
    if suffix in (".parquet", ".pq"):
        return Rows(_read_parquet(p))
    raise UserError(f"cannot read {p}: unknown file type '{p.suffix}' (use {FORMATS_HELP})")


def _open_text(p: Path):
    if p.suffix == ".gz":
        import gzip

        return gzip.open(p, "rt", encoding="utf-8")
    return open(p, encoding="utf-8")


def _read_jsonl(p: Path) -> Rows:
    rows, bad = [], []
    with _open_text(p) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                bad.append("line is not valid JSON")
                continue
            if isinstance(obj, dict):
                rows.append(obj)
            else:
                bad.append("line is not a JSON object")
    return Rows(rows, bad)


def _read_json(p: Path) -> Rows:
    try:
        with _open_text(p) as f:
            data = json.load(f)
    except json.JSONDecodeError:
        return _read_jsonl(p)  # many ".json" files are really JSON lines
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), [data])
    if not isinstance(data, list):
        raise UserError(f"{p} must hold a list of objects (or one JSON object per line)")
    rows = [r for r in data if isinstance(r, dict)]
    return Rows(rows, ["item is not a JSON object"] * (len(data) - len(rows)))


def _read_parquet(p: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(p).to_pylist()
    except Exception as e:  # noqa: BLE001 (pyarrow raises several types for a damaged file)
        raise UserError(f"cannot read {p} as Parquet: {str(e).splitlines()[0]}") from None


def _read_datasets_dir(p: Path, split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(p))
    except (FileNotFoundError, ValueError) as e:
        raise UserError(
            f"{p} is not a `datasets` directory saved with save_to_disk: {str(e).splitlines()[0]}"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UserError(f"{p} has splits {', '.join(ds)} but no '{split}' split")
        ds = ds[split]
    return ds.to_list()


def first_rows(path: str | Path, n: int = 32) -> tuple[list[dict], list[str]] | None:
    """(the first ``n`` rows, the column names) read cheaply (no full read, no `datasets` import), for the
    checks before launch; None for a `datasets` directory (too heavy to open there). An empty file gives
    ``([], columns)``."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"data not found: {p} (pass {FORMATS_HELP})")
    if p.is_dir():
        return None
    suffix = "".join(p.suffixes[-2:]) if p.suffix == ".gz" else p.suffix
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        try:
            f = pq.ParquetFile(p)
            columns = list(f.schema_arrow.names)
            batch = next(f.iter_batches(batch_size=n), None)
        except Exception as e:  # noqa: BLE001 (pyarrow raises several types for a damaged file)
            raise UserError(f"cannot read {p} as Parquet: {str(e).splitlines()[0]}") from None
        return (batch.to_pylist() if batch is not None else []), columns
    if suffix in (".jsonl", ".jsonl.gz", ".ndjson"):
        rows, lines = [], 0
        with _open_text(p) as f:
            for line in f:
                if len(rows) >= n or lines >= 4 * n:
                    break
                if not line.strip():
                    continue
                lines += 1
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(obj, dict):
                    rows.append(obj)
        if lines and not rows:
            return None  # only unreadable lines so far: the ranks count them as bad rows and say so
    else:
        rows = read_rows(p).rows[:n]
    return rows, sorted({k for r in rows for k in r})
