"""A user's own files as a task: ``jsonl:PATH``, ``csv:PATH``, ``parquet:PATH``, ``disk:PATH``.

Files are read by `datasets` itself (``load_dataset("json" | "csv" | "parquet", data_files=...)``,
``load_from_disk`` for a folder written by ``save_to_disk``, a Dataset or a DatasetDict); this
module only checks and splits the rows.

Columns: ``context``, ``question``, ``answer`` (a string, or a list of accepted answers; the first
is the training target), optional ``id``; other columns are ignored. Another naming maps by
``columns={"context": "passage"}`` (``data.columns.context=passage`` in a training config).

Splits, in this order of preference:
- one file per split: ``jsonl:train=a.jsonl,test=b.jsonl`` (``validation=`` too);
- a DatasetDict's own splits (``disk:``);
- a ``split`` column whose values are train / validation / test;
- otherwise validation and test are carved from the rows by seeded fractions of the distinct
  contexts (``validation_fraction``, ``test_fraction``), so no context is in two splits.
A split the source does not give (say validation next to train and test files) is carved from
train the same way.

Bad input raises `TaskFormatError` (a ValueError) in one line naming the file, and the line where
the format has lines (JSON Lines, CSV): a missing file, missing columns (the columns found are
listed), an empty or non-string field, a split with no rows, a context longer than ``max_tokens``
tokens of the LM (pass ``max_tokens=None`` where the sender cuts long contexts and counts them),
a question or answer longer than ``text_limit`` tokens (refused by its characters first, before it
is tokenised), an id given twice, the same row twice, and splits given apart that share contexts
or a file (``allow_overlap=True``, ``data.allow_split_overlap``, accepts the last, and eval's report
says so).

The cache key (`file_config_key`) hashes the files' content, not their paths.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import datasets

from ..checks import text_length
from .base import SPLITS, TaskFormatError, check_fraction, check_limit, check_split, file_sha256, to_dataset
from .file_reading import Row, check_exists, read_file, rows_of
from .registry import EvalTaskContext, EvalRows, Task, register_task

REQUIRED = ("context", "question", "answer")
OPTIONAL = ("id",)
# Bump when the same files and settings would give other rows.
FILES_VERSION = 1


@dataclass(frozen=True)
class FileSource:
    """A parsed file task name: the format and either one path or one path per split."""

    fmt: str  # a key of FORMATS
    paths: tuple[tuple[str, Path], ...]  # (("all", path),) or ((split, path), ...)

    @property
    def name(self) -> str:
        if self.paths[0][0] == "all":
            return f"{self.fmt}:{self.paths[0][1]}"
        return f"{self.fmt}:" + ",".join(f"{split}={path}" for split, path in self.paths)

_NAME = re.compile(r"(jsonl|csv|parquet|disk):(.+)\Z", re.DOTALL)


def parse_file_name(name: str) -> FileSource:
    """``jsonl:PATH`` or ``jsonl:train=A,test=B`` (and csv / parquet / disk) as a `FileSource`."""
    match = _NAME.match(name.strip())
    if match is None:
        raise ValueError(f"not a file task: {name!r}; use jsonl:PATH, csv:PATH, parquet:PATH or disk:PATH")
    fmt, spec = match.group(1), match.group(2).strip()
    if not spec:
        raise ValueError(f"task {name!r} names no file")
    parts = [part.strip() for part in spec.split(",")]
    if all("=" in part and part.split("=", 1)[0].strip() in SPLITS for part in parts):
        paths = []
        for part in parts:
            split, path = (s.strip() for s in part.split("=", 1))
            if not path:
                raise ValueError(f"task {name!r}: split {split!r} names no file")
            paths.append((split, Path(path)))
        splits = [split for split, _ in paths]
        if len(set(splits)) != len(splits):
            raise ValueError(f"task {name!r} names a split twice")
        if fmt == "disk":
            raise ValueError(f"task {name!r}: disk: takes one folder (a DatasetDict holds its own splits)")
        return FileSource(fmt, tuple(sorted(paths, key=lambda p: SPLITS.index(p[0]))))
    return FileSource(fmt, (("all", Path(spec)),))


# ------------------------------------------------------------------------------------ checking

def _map_columns(found: list[str], columns: dict, label: str) -> dict:
    """{standard name: column in the file} for the required and the optional columns present."""
    unknown = sorted(set(columns) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise ValueError(f"columns: unknown key(s) {', '.join(unknown)}; map context, question, answer or id")
    mapping = {name: columns.get(name, name) for name in REQUIRED + OPTIONAL}
    missing = [f"{name}" + (f" (as {mapping[name]!r})" if mapping[name] != name else "")
               for name in REQUIRED if mapping[name] not in found]
    if missing:
        hint = "; map other names with data.columns.NAME=COLUMN" if not columns else ""
        raise TaskFormatError(f"{label}: missing column(s) {', '.join(missing)}; the columns found are "
                              f"{', '.join(found) or 'none'}{hint}")
    return {name: column for name, column in mapping.items() if column in found}


def _text(value, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise TaskFormatError(f"{where}: {field} must be a string, got {_kind(value)}")
    if not value.strip():
        raise TaskFormatError(f"{where}: {field} is empty")
    return value


def _kind(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {str(value)[:40]!r}"


def _answers(value, field: str, where: str) -> list[str]:
    if isinstance(value, str):
        return [_text(value, field, where)]
    if isinstance(value, (list, tuple)):
        if not value:
            raise TaskFormatError(f"{where}: {field} is an empty list")
        return [_text(v, f"{field}[{i}]", where) for i, v in enumerate(value)]
    raise TaskFormatError(f"{where}: {field} must be a string or a list of strings, got {_kind(value)}")


def _standard(row: Row, mapping: dict, task: str, split: str, index: int, stem: str) -> dict:
    v = row.values
    answers = _answers(v[mapping["answer"]], mapping["answer"], row.where)
    if "id" in mapping and v[mapping["id"]] is not None:
        raw = v[mapping["id"]]
        if isinstance(raw, bool) or not isinstance(raw, (str, int)) or not str(raw).strip():
            raise TaskFormatError(f"{row.where}: {mapping['id']} must be a non-empty string or an int, got {_kind(raw)}")
        row_id = str(raw)
    else:
        row_id = f"{stem}-{split}-{index}"
    return {"id": row_id, "task": task, "context": _text(v[mapping["context"]], mapping["context"], row.where),
            "question": _text(v[mapping["question"]], mapping["question"], row.where),
            "answer": answers[0], "answers": answers}


def _carve(rows: list[tuple[dict, Row]], validation_fraction: float, test_fraction: float,
           seed: int) -> dict[str, list]:
    """train / validation / test by whole contexts: the distinct contexts ranked by a seeded hash,
    the first ``test_fraction`` of them test, the next ``validation_fraction`` validation."""
    contexts = sorted({row["context"] for row, _ in rows},
                      key=lambda c: hashlib.sha256(f"ilcp-files/{seed}/{c}".encode()).hexdigest())

    def count(fraction: float) -> int:
        return max(1, round(fraction * len(contexts))) if fraction > 0 and len(contexts) >= 3 else 0

    n_test, n_val = count(test_fraction), count(validation_fraction)
    split_of = {c: "test" if i < n_test else "validation" if i < n_test + n_val else "train"
                for i, c in enumerate(contexts)}
    out = {split: [] for split in SPLITS}
    for row, raw in rows:
        out[split_of[row["context"]]].append((row, raw))
    return out


def load_files(name: str, split: str, *, columns: dict | None = None, validation_fraction: float = 0.1,
               test_fraction: float = 0.1, seed: int = 0, limit: int | None = None, tokenizer=None,
               max_tokens: int | None = None, text_limit: int | None = None,
               allow_overlap: bool = False) -> datasets.Dataset:
    """Rows (``ilcp.tasks.TASK_COLUMNS``) of a file task's split; see the module docstring.

    ``tokenizer`` and ``max_tokens``: with both, a context longer than ``max_tokens`` tokens is an
    error naming its file and line; ``text_limit``: the same for a question or an answer (by its
    characters without a tokenizer). ``limit`` keeps the first N rows of the split.
    ``allow_overlap``: accept given splits that share contexts or a file.
    """
    check_split(split)
    check_limit(limit)
    check_fraction("validation_fraction", validation_fraction)
    check_fraction("test_fraction", test_fraction)
    if validation_fraction + test_fraction >= 1:
        raise ValueError(f"validation_fraction + test_fraction must be below 1, got {validation_fraction} + {test_fraction}")
    columns = dict(columns or {})
    source = parse_file_name(name)
    task = source.name
    by_split = _split_rows(source, columns, task, validation_fraction, test_fraction, seed, allow_overlap)
    chosen = by_split[split]
    if not chosen:
        origin = ", ".join(str(p) for _, p in source.paths)
        raise TaskFormatError(f"{origin}: the {split} split has no rows"
                              + (" (carved by fraction: give more rows or a larger fraction)" if split != "train" else ""))
    if limit is not None:
        chosen = chosen[:limit]
    if text_limit is not None:
        for row, raw in chosen:
            for field, text in [("question", row["question"])] + [("answer", a) for a in row["answers"]]:
                _check_text_tokens(raw.where, field, text, tokenizer, text_limit)
    if tokenizer is not None and max_tokens is not None:
        for row, raw in chosen:
            n = len(tokenizer.encode(row["context"], add_special_tokens=False))
            if n > max_tokens:
                raise TaskFormatError(f"{raw.where}: the context is {n:,} tokens, longer than the LM's limit of "
                                      f"{max_tokens:,}; shorten it, or set data.max_length to cut contexts to their "
                                      "last tokens")
    return to_dataset([row for row, _ in chosen])


def _check_text_tokens(where: str, field: str, text: str, tokenizer, limit: int) -> None:
    """A question or answer within the LM's `limit` tokens: by its characters first (so a huge one
    is refused before it is tokenised), then by its tokens when there is a tokenizer."""
    try:
        text_length(f"the {field}", len(text), limit)
    except ValueError as e:
        raise TaskFormatError(f"{where}: {e}") from None
    if tokenizer is not None:
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if n > limit:
            raise TaskFormatError(f"{where}: the {field} is {n:,} tokens, longer than the LM's limit of {limit:,}; "
                                  "shorten it")


def _check_unique(rows: list[tuple[dict, Row]], has_ids: bool) -> None:
    """Refuse an id given twice (answers are joined back to rows by id) and a row given twice."""
    seen_ids: dict[str, str] = {}
    seen_rows: dict[tuple, str] = {}
    for row, raw in rows:
        if has_ids:
            if row["id"] in seen_ids:
                raise TaskFormatError(f"{raw.where}: id {row['id']!r} is also the id of {seen_ids[row['id']]}: ids must "
                                      "be unique (eval joins each answer back to its row by id)")
            seen_ids[row["id"]] = raw.where
        key = (row["context"], row["question"], tuple(row["answers"]))
        if key in seen_rows:
            raise TaskFormatError(f"{raw.where}: the same row (context, question and answer) as {seen_rows[key]}: "
                                  "remove the copy")
        seen_rows[key] = raw.where


def _check_apart(source: FileSource, given: dict[str, list[tuple[dict, Row]]]) -> None:
    """Refuse given splits that share a file or contexts with train (evaluation would score rows
    the run trained on)."""
    files: dict[tuple, str] = {}
    for split, path in source.paths:
        same = _content_hash(source.fmt, path)
        if same in files:
            raise TaskFormatError(f"{path}: the {split} file holds the same rows as the {files[same]} file; give "
                                  "splits apart, drop the per-split names to carve splits, or set "
                                  "data.allow_split_overlap=true to accept it")
        files[same] = split
    train = {row["context"] for row, _ in given.get("train", [])}
    for split in ("validation", "test"):
        shared = [raw for row, raw in given.get(split, []) if row["context"] in train]
        if shared:
            raise TaskFormatError(f"{shared[0].where}: this {split} row's context is also in train ({len(shared)} "
                                  f"{split} row(s) share a context with train); give splits apart, drop the per-split "
                                  "names to carve splits, or set data.allow_split_overlap=true to accept it")


def _split_rows(source: FileSource, columns: dict, task: str, validation_fraction: float,
                test_fraction: float, seed: int, allow_overlap: bool = False) -> dict[str, list[tuple[dict, Row]]]:
    """Every split's standard rows, each with where it came from; given splits apart (unless
    ``allow_overlap``), and ids and rows unique within each split."""
    given: dict[str, list[tuple[dict, Row]]] = {}
    has_ids = False
    stem = source.paths[0][1].stem or "row"
    for part, path in source.paths:
        data = read_file(source.fmt, path, (columns.get("answer", "answer"),))
        label = str(path)
        if isinstance(data, datasets.DatasetDict):
            unknown = [s for s in data if s not in SPLITS]
            if unknown:
                raise TaskFormatError(f"{label}: a DatasetDict with split(s) {', '.join(unknown)}; name them "
                                      f"{', '.join(SPLITS)}")
            parts = {s: data[s] for s in data}
        else:
            parts = {part: data}
        for split_name, ds in parts.items():
            mapping = _map_columns(list(ds.column_names), columns, label)
            has_ids = has_ids or "id" in mapping
            for raw in rows_of(source.fmt, path, ds, label):
                target = split_name
                if split_name == "all" and "split" in ds.column_names:
                    target = raw.values["split"]
                    if target not in SPLITS:
                        raise TaskFormatError(f"{raw.where}: split must be one of {', '.join(SPLITS)}, "
                                              f"got {_kind(target)}")
                rows = given.setdefault(target, [])
                rows.append((_standard(raw, mapping, task, target, len(rows), stem), raw))
    if not set(given) <= {"all"} and "train" not in given:
        origin = ", ".join(str(p) for _, p in source.paths)
        raise TaskFormatError(f"{origin}: no train split (name a train file, or drop the per-split names to carve "
                              "splits from all rows)")
    if not allow_overlap and not set(given) <= {"all"}:
        _check_apart(source, given)
    for rows in given.values():  # answers are joined back to rows within a split
        _check_unique(rows, has_ids)
    if set(given) <= {"all"}:  # nothing says which row is which split
        return _carve(given.get("all", []), validation_fraction, test_fraction, seed)
    missing = [s for s in ("validation", "test") if s not in given]
    if missing:  # carved from train, by whole contexts
        carved = _carve(given["train"], validation_fraction if "validation" in missing else 0.0,
                        test_fraction if "test" in missing else 0.0, seed)
        given["train"] = carved["train"]
        for s in missing:
            given[s] = carved[s]
    return {s: given.get(s, []) for s in SPLITS}


def _content_hash(fmt: str, path: Path) -> str:
    check_exists(fmt, path)
    if fmt != "disk":
        return file_sha256(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0" + file_sha256(file).encode())
    return digest.hexdigest()[:16]


def file_config_key(name: str, split: str, *, columns: dict | None = None, validation_fraction: float = 0.1,
                    test_fraction: float = 0.1, seed: int = 0, limit: int | None = None, **_ignored) -> dict:
    """What `load_files` builds, JSON-serialisable: the format, each file's content hash (not its
    path), the column mapping, the split settings and ``FILES_VERSION``."""
    check_split(split)
    source = parse_file_name(name)
    return {"task": f"{source.fmt}:<content>", "format": source.fmt, "split": split, "limit": limit,
            "content_sha256": {part: _content_hash(source.fmt, path) for part, path in source.paths},
            "columns": dict(sorted((columns or {}).items())), "validation_fraction": validation_fraction,
            "test_fraction": test_fraction, "seed": seed, "version": FILES_VERSION}


# ------------------------------------------------------------------------------------- registry

class FileTask(Task):
    """``jsonl:PATH`` and the other formats: open-text answers, scored with SQuAD's EM and F1."""

    open_answers = True

    def __init__(self, name: str):
        self.source = parse_file_name(name)
        self.name = self.source.name

    def load(self, split: str, **kwargs) -> datasets.Dataset:
        return load_files(self.name, split, **kwargs)

    def config_key(self, split: str, **kwargs) -> dict:
        return file_config_key(self.name, split, **kwargs)

    def training_kwargs(self, data, size: int, tokenizer=None, max_tokens: int | None = None, *,
                        text_limit: int | None = None) -> dict:
        return {"columns": dict(data.columns), "validation_fraction": data.validation_fraction,
                "test_fraction": data.test_fraction, "seed": data.seed, "limit": size, "tokenizer": tokenizer,
                "max_tokens": max_tokens, "text_limit": text_limit, "allow_overlap": data.allow_split_overlap}

    def task_settings(self, data) -> dict:
        settings = {"columns": dict(data.columns), "validation_fraction": data.validation_fraction,
                    "test_fraction": data.test_fraction}
        if data.allow_split_overlap:  # recorded only when set, so other exports read as before
            settings["allow_split_overlap"] = True
        return settings

    def eval_rows(self, limit: int | None, context: EvalTaskContext) -> EvalRows:
        """The split asked (``context.split``), carved with the run's split settings (config.json ``task_settings``) and
        read with its column names (``columns``)."""
        s = context.task_settings
        overlap = bool(s.get("allow_split_overlap", False))
        rows = self.load(context.split, columns=s.get("columns") or {}, validation_fraction=s.get("validation_fraction", 0.1),
                         test_fraction=s.get("test_fraction", 0.1), seed=s.get("seed", 0), tokenizer=context.tokenizer,
                         max_tokens=context.max_tokens, text_limit=context.text_limit,
                         allow_overlap=overlap).to_list()
        what = f"{self.name}, {context.split} split" + (" (its contexts may also be in train: the run set "
                                             "data.allow_split_overlap=true)" if overlap else "")
        return EvalRows(rows if limit is None else rows[:limit], len(rows), what)

    def check_evaluable(self) -> None:
        for _, path in self.source.paths:
            check_exists(self.source.fmt, path)

    def check_trainable(self) -> None:
        self.check_evaluable()


@register_task("files")
def _resolve_files(name: str) -> Task:
    return FileTask(name)
