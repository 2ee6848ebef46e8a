"""Reading a user's file of rows through `datasets`: one line naming the file (and the line, where
the format has lines) for anything that does not read, and rows that know where they came from.

Every file is read from a copy keyed by its content where `datasets` would otherwise cache it by
path and modification time (`content_cache`): a file rewritten in place is always read anew. A
UTF-8 byte-order mark (spreadsheets write one) is dropped in that copy.
"""

from __future__ import annotations

import codecs
import contextlib
import csv
import errno
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import datasets

from ..datadir import default_cache_dir
from ..io import atomic_write_text
from .base import TaskFormatError, file_sha256

FORMATS = {"jsonl": "json", "csv": "csv", "parquet": "parquet", "disk": None}



@contextlib.contextmanager
def _quiet():
    """No progress bars or logs from `datasets` while a small file is read: its own error lines
    ("Failed to read file ...") too, since a file that does not read is refused in one line."""
    bars = datasets.is_progress_bar_enabled()
    level = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def check_exists(fmt: str, path: Path) -> None:
    """A TaskFormatError naming `path` unless it is what `fmt` reads: a folder for ``disk``, else a
    regular file (not a FIFO, a device or a link to one, which would block or never end)."""
    if fmt == "disk":
        try:
            is_folder = stat.S_ISDIR(path.stat().st_mode)
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise TaskFormatError(f"{path}: {_unreachable(path, e, 'folder')}") from None
            is_folder = False
        if not is_folder:
            raise TaskFormatError(f"{path}: no such folder (disk: reads a folder written by datasets' save_to_disk)")
        return
    try:
        mode = path.stat().st_mode
    except OSError as e:
        raise TaskFormatError(f"{path}: {_unreachable(path, e)}") from None
    if stat.S_ISDIR(mode):
        raise TaskFormatError(f"{path}: no such file (it is a folder)")
    if not stat.S_ISREG(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else \
            "not a regular file"
        raise TaskFormatError(f"{path}: {kind}{' (through a link)' if path.is_symlink() else ''}; a file task reads "
                              "a regular file: copy the rows into one")


def _unreachable(path: Path, error: OSError, what: str = "file") -> str:
    """Why a task path cannot be reached, with the fix: a link loop, a link to nothing, no file."""
    if error.errno == errno.ELOOP:
        return (f"a symbolic link that leads back to itself (a link loop): point the link at the {what}, or pass "
                f"the {what}")
    if path.is_symlink():
        return f"a symbolic link to {os.readlink(path)}, which does not exist: point the link at the {what}"
    return f"no such {what}"


BOM = codecs.BOM_UTF8


def _check_text(fmt: str, path: Path) -> bool:
    """Refuse a JSON Lines or CSV file that is empty, holds no row, or is not UTF-8 text, in one
    line naming it; True when it starts with a UTF-8 byte-order mark."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, rows, head = 0, 0, b""
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            if not head:
                head = block[:3]
            try:
                text = decoder.decode(block)
            except UnicodeDecodeError as e:
                at = offset + e.start
                raise TaskFormatError(f"{path}: not UTF-8 text (byte 0x{block[e.start]:02x} at offset {at:,}): save it "
                                      "as UTF-8") from None
            rows += sum(1 for line in text.splitlines() if line.strip(" \t\r\ufeff"))
            offset += len(block)
    if offset == 0:
        raise TaskFormatError(f"{path}: empty file: no rows")
    if rows <= (1 if fmt == "csv" else 0):  # a CSV file's first line is its header
        raise TaskFormatError(f"{path}: no rows" + (" (only a header line)" if rows else ""))
    return head == BOM


def _check_parquet_rows(path: Path) -> None:
    """Refuse a Parquet file whose footer counts no row, in one line naming it (a footer that does
    not read is left to `datasets`, whose error `_read_error` names)."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except Exception:  # noqa: BLE001  pyarrow raises several kinds for a file that is not Parquet
        return
    if metadata.num_rows == 0:
        raise TaskFormatError(f"{path}: no rows (a Parquet file of {metadata.num_columns} column(s) and 0 rows): "
                              "write the rows into it")


def _without_bom(path: Path) -> Path:
    """A copy of a UTF-8 file without its byte-order mark, in the cache under its content hash."""
    out = default_cache_dir() / "tasks" / f"{file_sha256(path)}-nobom" / path.name
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, path.read_bytes()[len(BOM):].decode("utf-8"))
    return out


def _datasets_cache(path: Path) -> str:
    """`datasets`' cache folder for a file: one per content, so a file rewritten in place (even
    with its size and modification time restored) is read anew, never served from the old rows."""
    return str(default_cache_dir() / "datasets" / file_sha256(path))


def read_file(fmt: str, path: Path, list_columns: tuple[str, ...] = ()) -> datasets.Dataset | datasets.DatasetDict:
    """The file's rows through `datasets`; a reading error is one line naming the file.

    CSV fields are read as text, never as numbers or missing values ("3e-4" stays "3e-4"). In JSON
    Lines a column that holds strings on some lines and lists on others (``list_columns``: the
    answer column) would make pyarrow give up and pandas guess types (turning "3e-4" into a
    float), so such a file is read with every value of those columns as a list. A JSON Lines or
    CSV file is checked first: UTF-8 (a byte-order mark is dropped), and at least one row."""
    check_exists(fmt, path)
    shown = path  # what a message names: the user's file, never a copy read in its place
    if fmt in ("jsonl", "csv") and _check_text(fmt, path):
        path = _without_bom(path)
    if fmt == "parquet":
        _check_parquet_rows(path)
    try:
        with _quiet():
            if fmt == "disk":
                return datasets.load_from_disk(str(path))
            cache_dir = _datasets_cache(path)
            if fmt == "csv":
                text = datasets.Features({name: datasets.Value("string") for name in _csv_header(path)})
                return datasets.load_dataset("csv", data_files=str(path), split="train", features=text,
                                             na_filter=False, cache_dir=cache_dir)
            if fmt == "jsonl" and _mixed_json_columns(path, list_columns, shown):
                path = _listed_json(path, list_columns)
            return datasets.load_dataset(FORMATS[fmt], data_files=str(path), split="train", cache_dir=cache_dir)
    except TaskFormatError:
        raise
    except Exception as e:  # noqa: BLE001  datasets / pyarrow raise many kinds for a malformed file
        raise TaskFormatError(_read_error(fmt, path, e, shown)) from None


def _csv_header(path: Path) -> list[str]:
    """The column names of a CSV file's first record (so every column is read as text)."""
    with open(path, encoding="utf-8", errors="replace", newline="") as handle:
        header = next(csv.reader(handle), None)
    if not header:
        raise TaskFormatError(f"{path}: empty, or no header line")
    return header


def _json_lines(path: Path, shown: Path):
    """(line number, object) of each non-blank line; TaskFormatError at the first bad one, naming
    ``shown`` (the user's file, where ``path`` is a copy of it)."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                raise TaskFormatError(f"{shown}, line {number}: not a JSON object ({e})") from None
            if not isinstance(value, dict):
                raise TaskFormatError(f"{shown}, line {number}: not a JSON object (got {type(value).__name__})")
            yield number, value


def _mixed_json_columns(path: Path, columns: tuple[str, ...], shown: Path) -> bool:
    """Whether any of ``columns`` holds a list on one line and something else on another."""
    kinds = {column: set() for column in columns}
    for _, value in _json_lines(path, shown):
        for column in columns:
            if column in value:
                kinds[column].add(isinstance(value[column], list))
    return any(len(k) > 1 for k in kinds.values())


def _listed_json(path: Path, columns: tuple[str, ...]) -> Path:
    """A copy of a JSON Lines file, line for line (blank lines kept, so line numbers hold), with each
    string of ``columns`` wrapped in a list. Kept in the cache under the source's content hash, so
    `datasets` reuses its own cache of it."""
    out = default_cache_dir() / "tasks" / f"{file_sha256(path)}-{'-'.join(columns)}" / path.name
    if out.is_file():
        return out
    lines = []
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.strip():
                lines.append("\n")
                continue
            value = json.loads(line)
            for column in columns:
                if isinstance(value.get(column), str):
                    value[column] = [value[column]]
            lines.append(json.dumps(value, ensure_ascii=False) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "".join(lines))
    return out


def _read_error(fmt: str, path: Path, error: Exception, shown: Path) -> str:
    if fmt == "jsonl":
        for _ in _json_lines(path, shown):  # TaskFormatError at the first line that is not a JSON object
            pass
    if fmt == "csv":
        ragged = _ragged_csv_record(path, shown)
        if ragged:
            return ragged
    cause = error.__cause__ or error.__context__ or error
    what = " ".join(str(cause).split())[:200] or type(cause).__name__
    kind = {"disk": "a folder written by datasets' save_to_disk", "jsonl": "JSON Lines", "csv": "CSV",
            "parquet": "Parquet"}[fmt]
    return f"{shown}: not readable as {kind}: {what}"


def _ragged_csv_record(path: Path, shown: Path) -> str | None:
    """A one-line refusal naming the first CSV record with more fields than the header line, or
    the first quote that does not close; None when neither is found."""
    with open(path, encoding="utf-8", errors="replace", newline="") as handle:
        reader = csv.reader(handle, strict=True)
        start = 1
        try:
            header = next(reader, None) or []
            start = reader.line_num + 1
            for record in reader:
                if len(record) > len(header):
                    return (f"{shown}, line {start}: {len(record)} fields where the header line has {len(header)}: "
                            'put a field that holds a comma in double quotes ("a, b")')
                start = reader.line_num + 1
        except csv.Error as e:
            return (f"{shown}, line {start}: not readable as CSV ({e}): close every double quote, and write a quote "
                    'inside a quoted field as two ("")')
    return None


def _line_numbers(fmt: str, path: Path, n_rows: int) -> list[int] | None:
    """The line on which each row starts, for formats that have lines (None otherwise)."""
    if fmt == "jsonl":
        with open(path, encoding="utf-8", errors="replace") as handle:
            lines = [number for number, line in enumerate(handle, start=1) if line.strip()]
    elif fmt == "csv":
        with open(path, encoding="utf-8", errors="replace", newline="") as handle:
            reader = csv.reader(handle)
            lines, start = [], 1
            for i, record in enumerate(reader):
                if i > 0 and any(field.strip() for field in record):
                    lines.append(start)
                start = reader.line_num + 1
    else:
        return None
    return lines if len(lines) == n_rows else None


@dataclass
class Row:
    values: dict
    where: str  # "FILE, line N" or "FILE, row N": where an error points


def rows_of(fmt: str, path: Path, ds: datasets.Dataset, label: str) -> list[Row]:
    lines = _line_numbers(fmt, path, len(ds))
    where = ([f"{label}, line {n}" for n in lines] if lines is not None
             else [f"{label}, row {i + 1}" for i in range(len(ds))])
    return [Row(values, w) for values, w in zip(ds.to_list(), where)]
