"""What every task source shares: the row columns, the splits, argument checks, interleaving and
content hashes for cache keys."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import datasets

# ``answer`` is the training target (one string); ``answers`` every accepted answer, the target first.
TASK_COLUMNS = ("id", "task", "context", "question", "answer", "answers")
SPLITS = ("train", "validation", "test")

_FEATURES = datasets.Features({**{column: datasets.Value("string") for column in TASK_COLUMNS[:5]},
                               "answers": datasets.Sequence(datasets.Value("string"))})


class TaskFormatError(ValueError):
    """A task file does not follow its format; the message names the file and the line."""


def to_dataset(rows: list[dict]) -> datasets.Dataset:
    """Rows ``{id, task, context, question, answer[, answers]}`` as a Dataset with ``TASK_COLUMNS``
    (``answers`` defaults to ``[answer]``)."""
    columns = {column: [row[column] for row in rows] for column in TASK_COLUMNS[:5]}
    columns["answers"] = [list(row.get("answers") or [row["answer"]]) for row in rows]
    return datasets.Dataset.from_dict(columns, features=_FEATURES)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; available: {', '.join(SPLITS)}")


def check_limit(limit) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or a non-negative int, got {limit!r}")


def check_fraction(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")


def interleave(groups: Sequence[Sequence]) -> list:
    """The items of all groups, each group spread evenly over the result (item i of a group of n
    sits at (i + 1/2) / n; ties go to the earlier group), so any prefix mixes them in proportion."""
    keyed = [(Fraction(2 * i + 1, 2 * len(group)), g, i)
             for g, group in enumerate(groups) for i in range(len(group))]
    return [groups[g][i] for _, g, i in sorted(keyed)]


def round_robin(groups: Sequence[Sequence]) -> list:
    """Item 0 of every group, then item 1 of every group, ...: any prefix holds the same number of
    items from each group (give or take one) until a group runs out."""
    longest = max((len(group) for group in groups), default=0)
    return [group[i] for i in range(longest) for group in groups if i < len(group)]


@functools.lru_cache(maxsize=256)
def _sha256_cached(path: str, inode: int, mtime_ns: int, ctime_ns: int, size: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def file_sha256(path: Path) -> str:
    """The first 16 hex characters of the sha256 of a file's content, cached by the file's inode,
    size and modification and change times: a rewrite whose modification time is restored (``cp
    -p``, ``rsync -t``) still changes its change time, which no user call can set back."""
    stat = path.stat()
    return _sha256_cached(str(path), stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)


def source_key(path: Path) -> tuple[str, str]:
    """(file name, content hash): what a cache key records of a source file (not its location)."""
    return path.name, file_sha256(path)
