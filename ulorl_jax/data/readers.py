"""Row readers for prompt data: JSON lines, parquet, and a local Hugging Face `datasets` folder.

Each reader yields (line, row) where `line` is the 1-based line (jsonl) or
row (parquet, datasets) number and `row` is a dict, or a `BadRow` saying
what is wrong with that line (bad JSON, not an object, not UTF-8). Readers
never raise on a bad line; they raise ValueError / FileNotFoundError only for
a missing or unreadable file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterator

FORMATS = ("jsonl", "parquet", "hf")


@dataclasses.dataclass(frozen=True)
class BadRow:
    """A skipped (or rejected) input row: where it is and why."""

    source: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.reason}"


def detect_format(path: str | Path) -> str:
    """"jsonl" (.jsonl / .json lines), "parquet", or "hf" (a `datasets.save_to_disk` folder)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"prompt data {str(p)!r} does not exist")
    if p.is_dir():
        if any((p / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return "hf"
        raise ValueError(f"prompt data folder {str(p)!r} is not a Hugging Face datasets folder "
                         "(no dataset_info.json / state.json / dataset_dict.json); pass a .jsonl or .parquet file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise ValueError(f"prompt data {str(p)!r}: unknown format {suffix!r} (use .jsonl, .parquet or a datasets folder)")


def read_rows(path: str | Path, *, split: str = "train") -> Iterator[tuple[int, dict | BadRow]]:
    """(line, row dict | BadRow) for every non-blank row of `path`, in file order."""
    fmt = detect_format(path)
    if fmt == "jsonl":
        return _read_jsonl(Path(path))
    if fmt == "parquet":
        return _read_parquet(Path(path))
    return _read_hf(Path(path), split)


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict | BadRow]]:
    source = str(path)
    with path.open("rb") as f:  # binary: split on b"\n" only, whatever other control characters a line holds
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield number, BadRow(source, number, f"not UTF-8 ({err.reason} at byte {err.start})")
                continue
            if not text.strip():
                continue  # blank lines are allowed (e.g. a trailing newline)
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                snippet = text.strip()
                snippet = snippet if len(snippet) <= 80 else snippet[:77] + "..."
                # some of json's messages end in "at" ("Invalid control character at"): one "at" only
                what = err.msg.removesuffix(" at")
                yield number, BadRow(source, number, f"bad JSON ({what} at column {err.colno}): {snippet!r}")
                continue
            except RecursionError:
                yield number, BadRow(source, number, "bad JSON: nested too deeply")
                continue
            if not isinstance(row, dict):
                yield number, BadRow(source, number, f"expected a JSON object, got {type(row).__name__}")
                continue
            yield number, row


def _read_parquet(path: Path) -> Iterator[tuple[int, dict | BadRow]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:  # noqa: BLE001  (pyarrow raises several types for a broken file)
        raise ValueError(f"cannot read parquet file {str(path)!r}: {err}") from None
    number = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            number += 1
            yield number, row


def _read_hf(path: Path, split: str) -> Iterator[tuple[int, dict | BadRow]]:
    try:
        import datasets
    except ModuleNotFoundError:
        raise ValueError(f"{str(path)!r} is a Hugging Face datasets folder; reading it needs the `datasets` "
                         "package: pip install datasets") from None
    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"datasets folder {str(path)!r} has splits {sorted(data)}, not split={split!r}")
        data = data[split]
    for number, row in enumerate(data, start=1):
        yield number, dict(row)
