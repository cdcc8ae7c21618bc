"""Reading rows from JSONL, JSON, Parquet, a directory of Parquet (or JSONL) shards, a `datasets`
directory saved with ``save_to_disk``, or a Hugging Face hub dataset name resolved through the local
cache (``datasets.load_dataset``; nothing is downloaded when ``HF_HUB_OFFLINE=1``, and a name that is
not cached is one line saying so).

Every reader returns plain Python dicts. A JSONL line that is not a JSON object is not fatal: it is
reported in :attr:`Rows.unreadable` so the caller can count it as a bad row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlctl.errors import UserError

FORMATS_HELP = (
    "JSONL (.jsonl), JSON (.json), Parquet (.parquet), a directory of Parquet shards, a `datasets` directory "
    "(save_to_disk) or a hub dataset name in the local cache"
)
SHARD_SUFFIXES = (".parquet", ".pq", ".jsonl", ".jsonl.gz", ".ndjson", ".json")


@dataclass
class Rows:
    rows: list[dict]
    unreadable: list[str] = field(default_factory=list)  # one reason per line that could not be parsed

    def __len__(self) -> int:
        return len(self.rows) + len(self.unreadable)


def looks_like_hub_name(path: str) -> bool:
    """``owner/name`` or ``name``: no file suffix, not a relative or absolute path that exists."""
    text = str(path)
    if not text or text.startswith((".", "/", "~")) or Path(text).expanduser().exists():
        return False
    return text.count("/") <= 1 and not Path(text).suffix


def check_source(path: str, key: str = "data.path", split: str = "train") -> None:
    """One line when ``path`` is neither an existing file / directory nor a cached hub dataset."""
    p = Path(path).expanduser()
    if p.exists():
        if p.is_dir() and not _is_datasets_dir(p) and not _shards(p):
            raise UserError(f"{p} ({key}) is a directory with no Parquet/JSONL shards and no save_to_disk dataset")
        return
    if not looks_like_hub_name(path):
        raise UserError(f"data file not found: {path} ({key}); pass {FORMATS_HELP}")
    hub_dataset(path, split)


def _is_datasets_dir(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or (p / "state.json").is_file()


def _shards(p: Path) -> list[Path]:
    """The data files of a directory of shards, in name order (searched recursively)."""
    return sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SHARD_SUFFIXES))


def hub_dataset(name: str, split: str = "train"):
    """A hub dataset from the local cache (offline); a one-line UserError when it is not there."""
    import datasets

    spec, _, config = name.partition("@")  # owner/name@config picks a configuration (e.g. openai/gsm8k@main)
    try:
        ds = datasets.load_dataset(spec, config or None, split=split)
    except ValueError as e:  # an unknown split
        raise UserError(f"hub dataset {name}: {str(e).splitlines()[0]} (set data.split)") from None
    except Exception as e:  # noqa: BLE001 (offline and not cached: ConnectionError, FileNotFoundError, ...)
        raise UserError(
            f"data not found: '{name}' is no file here and not a hub dataset in the local cache "
            f"({type(e).__name__}); with network run `python -c \"import datasets; datasets.load_dataset('{spec}')\"` "
            f"once, or pass a file"
        ) from None
    return ds


def read_rows(path: str | Path, *, split: str = "train") -> Rows:
    """Read every row of a data source (``split`` picks from a DatasetDict or a hub dataset)."""
    p = Path(path).expanduser()
    if not p.exists():
        if looks_like_hub_name(str(path)):
            return Rows(hub_dataset(str(path), split).to_list())
        raise UserError(f"data not found: {p} (pass {FORMATS_HELP})")
    if p.is_dir():
        if _is_datasets_dir(p):
            return Rows(_read_datasets_dir(p, split))
        shards = _shards(p)
        if not shards:
            raise UserError(f"{p} is a directory with no Parquet/JSONL shards and no save_to_disk dataset")
        rows = Rows([])
        for shard in shards:
            part = read_rows(shard)
            rows.rows.extend(part.rows)
            rows.unreadable.extend(part.unreadable)
        return rows
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
        if looks_like_hub_name(str(path)):
            return None  # a cached hub dataset: check_source opened it; the ranks report its rows
        raise UserError(f"data not found: {p} (pass {FORMATS_HELP})")
    if p.is_dir():
        shards = [] if _is_datasets_dir(p) else _shards(p)
        return first_rows(shards[0], n) if shards else None
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
                if lines == 1 and line.lstrip().startswith("["):
                    raise UserError(
                        f"{p} holds a JSON array, not one JSON object per line; rename it to .json, "
                        f"or write one object per line (JSON Lines)"
                    )
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
