"""bAbI (Weston et al. 2015, CC BY 3.0), read from files in the original format.

``ID text`` lines; ``ID question<TAB>answer<TAB>supporting ids`` for questions; a story restarts
when the ID goes back to 1. One row per question; its context is the story's statements before
it. The validation split is carved from the train file by whole stories. Files are looked up
under ``data_dir`` (default: ``$ILCP_BABI_DIR``, else the shipped ``data/babi``).

Names: ``babi:N`` (also ``babi-qaN``, ``qaN``), a mix ``babi:1+2+3``, or ``babi:all`` (every task
with both files in the ``en`` folder). A mix is balanced: its tasks' rows taken in turn, so the
first N rows hold the same number of rows of each task (give or take one); each row's ``task``
names its own task, and eval reports a mix task by task.
"""

from __future__ import annotations

import functools
import os
import random
import re
from collections.abc import Sequence
from pathlib import Path

import datasets

from ..datadir import data_root
from .base import TaskFormatError, check_fraction, check_limit, check_split, round_robin, source_key, to_dataset
from .registry import EvalTaskContext, EvalRows, Task, register_task

BABI_DIR_ENV = "ILCP_BABI_DIR"

# ----------------------------------------------------------------------------------------- bAbI

_LINE = re.compile(r"(\d+) +(.*)\Z", re.DOTALL)
_TASK = re.compile(r"(?:babi[-:_]?)?(?:qa)?(\d+)\Z", re.IGNORECASE)


@functools.lru_cache(maxsize=64)
def _parse_babi_cached(path: str, mtime_ns: int, size: int) -> tuple:
    stories: list[tuple] = []
    story: list[tuple] = []
    statements: list[str] = []
    previous_id = None

    def fail(line_no: int, what: str):
        raise TaskFormatError(f"{path}, line {line_no}: {what}")

    with open(path, "rb") as handle:  # decoded line by line, so bytes that are not UTF-8 are named where they stand
        for line_no, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                fail(line_no, f"not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}): a bAbI task file "
                              "is plain text")
            if not line.strip():
                continue
            match = _LINE.match(line)
            if match is None:
                fail(line_no, f"expected '<integer ID> <text>', got {line[:60]!r}")
            line_id, text = int(match.group(1)), match.group(2)
            if line_id == 1:
                if previous_id is not None:
                    stories.append(tuple(story))
                story, statements = [], []
            elif previous_id is None:
                fail(line_no, f"a story must start with ID 1, got ID {line_id}")
            elif line_id <= previous_id:
                fail(line_no, f"ID {line_id} does not increase (previous ID {previous_id}) "
                              "and is not a restart at 1")
            previous_id = line_id
            if "\t" in text:
                fields = text.split("\t")
                if len(fields) != 3:
                    fail(line_no, "a question line needs 3 tab-separated fields (question, answer, "
                                  f"supporting IDs), found {len(fields)}")
                question, answer, support = (field.strip() for field in fields)
                if not question:
                    fail(line_no, "empty question")
                if not answer:
                    fail(line_no, "empty answer")
                if support and not all(part.isdigit() for part in support.split()):
                    fail(line_no, f"supporting IDs must be integers, got {support!r}")
                story.append((" ".join(statements), question, answer))
            else:
                if not text.strip():
                    fail(line_no, "empty statement")
                statements.append(text.strip())
    if previous_id is not None:
        stories.append(tuple(story))
    if not any(stories):
        raise TaskFormatError(f"{path}: no question lines found")
    return tuple(stories)


def parse_babi_file(path: str | os.PathLike) -> tuple:
    """Parse one bAbI file into stories: a tuple per story of ``(context, question, answer)``
    triples, one per question line. Raises `TaskFormatError` on a malformed line."""
    stat = Path(path).stat()
    return _parse_babi_cached(str(path), stat.st_mtime_ns, stat.st_size)


def default_babi_dir() -> Path:
    """The shipped bAbI folder (``data/babi`` of the checkout, or of the installed package)."""
    return data_root() / "babi"


def babi_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The bAbI root: ``data_dir`` if given, else ``$ILCP_BABI_DIR``, else the shipped
    ``data/babi`` (`ilcp.datadir`). It holds one folder per variant (``en``, ``en-10k``)."""
    root = Path(data_dir or os.environ.get(BABI_DIR_ENV) or default_babi_dir())
    if not root.is_dir():
        raise FileNotFoundError(
            f"bAbI data directory {root} not found: {_point_at(data_dir, 'a folder that holds')} the bAbI v1.2 task "
            "folders (en/, en-10k/), or copy them there")
    return root


def _point_at(data_dir, what: str) -> str:
    """The remedy for a missing bAbI file: the argument the caller passed (a library call's
    ``data_dir=``), else the environment variable, the only way train.py and eval.py take."""
    if data_dir:
        return f"point data_dir= at {what}"
    return f"set {BABI_DIR_ENV} (read by train.py, eval.py and the library) to {what}"


def _babi_task_number(task: int | str) -> int:
    if isinstance(task, int) and not isinstance(task, bool):
        number = task
    else:
        match = _TASK.match(str(task).strip())
        number = int(match.group(1)) if match else 0
    if number < 1:
        raise ValueError(f"unknown bAbI task {task!r}: use a task number such as 1, '1', 'qa1', "
                         "'babi-qa1' or 'babi:1'")
    return number


def babi_file(task: int | str, split: str, *, variant: str = "en",
              data_dir: str | os.PathLike | None = None) -> Path:
    """The file a split of a bAbI task is read from (validation is carved from the train file)."""
    check_split(split)
    number = _babi_task_number(task)
    root = babi_data_dir(data_dir)
    variants = sorted(p.name for p in root.iterdir() if p.is_dir())
    if variant not in variants:
        raise ValueError(f"unknown bAbI variant {variant!r}; available in {root}: "
                         f"{', '.join(variants) or 'none'}")
    folder = root / variant
    stem = "test" if split == "test" else "train"
    matches = sorted(folder.glob(f"qa{number}_*_{stem}.txt"))
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"several files match bAbI task {number} in {folder}: "
                         f"{', '.join(p.name for p in matches)}")
    available = sorted({int(m.group(1)) for p in folder.glob("qa*_*.txt")
                        if (m := re.match(r"qa(\d+)_", p.name))})
    raise FileNotFoundError(
        f"no file {folder / f'qa{number}_*_{stem}.txt'} (tasks available there: "
        f"{', '.join(map(str, available)) or 'none'}); copy the bAbI task file there, or "
        f"{_point_at(data_dir, f'a folder whose {variant}/ holds it')}")


def _validation_stories(n_stories: int, fraction: float, seed: int) -> set[int]:
    count = round(n_stories * fraction)
    if fraction > 0 and n_stories > 1:
        count = min(max(count, 1), n_stories - 1)
    return set(random.Random(f"ilcp-babi-validation/{seed}").sample(range(n_stories), count))


def _check_validation_fraction(validation_fraction: float) -> None:
    check_fraction("validation_fraction", validation_fraction)


def _split_stories(n_stories: int, split: str, validation_fraction: float, seed: int) -> list[int]:
    """Indices of the stories of a file that belong to ``split`` (test: all of the test file's)."""
    chosen = range(n_stories)
    if split == "test":
        return list(chosen)
    held_out = _validation_stories(n_stories, validation_fraction, seed)
    return [i for i in chosen if (i in held_out) == (split == "validation")]


def load_babi(task: int | str, split: str, *, variant: str = "en",
              data_dir: str | os.PathLike | None = None, limit: int | None = None,
              validation_fraction: float = 0.1, seed: int = 0) -> datasets.Dataset:
    """Rows for one bAbI task and split ("train", "validation" or "test").

    ``task`` is 1, "1", "qa1", "babi-qa1" or "babi:1". Validation holds a seeded, deterministic
    ``validation_fraction`` of the train file's stories (whole stories, so none is in both);
    train holds the rest. ``limit`` keeps the first N rows. Row ids are
    ``babi-qa{N}[-{variant}]-{split}-s{story}-q{question}`` (the variant only when not "en"; the
    story index counts from 0 within its file, the question index from 0 within its story).
    """
    _check_validation_fraction(validation_fraction)
    check_limit(limit)
    path = babi_file(task, split, variant=variant, data_dir=data_dir)
    stories = parse_babi_file(path)
    number = _babi_task_number(task)
    name = f"babi-qa{number}"
    prefix = name if variant == "en" else f"{name}-{variant.replace('-', '')}"
    chosen = _split_stories(len(stories), split, validation_fraction, seed)
    rows = [
        {"id": f"{prefix}-{split}-s{s}-q{q}", "task": name,
         "context": context, "question": question, "answer": answer}
        for s in chosen for q, (context, question, answer) in enumerate(stories[s])
    ]
    return to_dataset(rows if limit is None else rows[:limit])


ALL = "all"  # babi:all: every task with both files in the en folder


def available_tasks(variant: str = "en", data_dir: str | os.PathLike | None = None) -> tuple[int, ...]:
    """The task numbers with both a train and a test file in a variant's folder."""
    folder = babi_data_dir(data_dir) / variant
    found = {stem: {int(m.group(1)) for p in folder.glob(f"qa*_*_{stem}.txt") if (m := re.match(r"qa(\d+)_", p.name))}
             for stem in ("train", "test")}
    return tuple(sorted(found["train"] & found["test"]))


def babi_task_numbers(tasks: int | str | Sequence[int | str], *,
                      data_dir: str | os.PathLike | None = None) -> tuple[int, ...]:
    """Sorted task numbers of a mix: "1+2+3", "babi:1+2", "qa1+qa3", [1, "babi:2"], one task, or
    "all" / "babi:all" (`available_tasks` of the ``en`` folder under ``data_dir``)."""
    if isinstance(tasks, str) and re.fullmatch(r"(?:babi[-:_]?)?all", tasks.strip(), re.IGNORECASE):
        numbers = available_tasks("en", data_dir)
        if not numbers:
            raise FileNotFoundError(f"babi:all: no bAbI task has both files in {babi_data_dir(data_dir) / 'en'}")
        return numbers
    if isinstance(tasks, str):
        parts = tasks.split("+")
    elif isinstance(tasks, (list, tuple)):
        parts = list(tasks)
    else:
        parts = [tasks]
    if not parts:
        raise ValueError("a bAbI mix needs at least one task")
    numbers = [_babi_task_number(part) for part in parts]
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"bAbI task listed twice in {tasks!r}")
    return tuple(sorted(numbers))


def load_babi_mix(tasks: str | Sequence[int | str], split: str, *, variant: str = "en",
                  data_dir: str | os.PathLike | None = None, limit: int | None = None,
                  validation_fraction: float = 0.1, seed: int = 0) -> datasets.Dataset:
    """Rows of several bAbI tasks ("1+2+3", "babi:1+2", or a list such as [1, "qa2"]).

    Each task contributes exactly the rows `load_babi` gives it for the same arguments (so the
    validation split is carved from each train file by whole stories, and ids and the ``task``
    column name the row's own task); the tasks are sorted by number and their rows taken in turn
    (`round_robin`), so the first N rows (``limit``) hold the same number of rows of every task,
    give or take one, until the smallest task runs out. A single task gives the same rows as
    `load_babi`. ``tasks="all"``: every task of the shipped ``en`` folder.
    """
    _check_validation_fraction(validation_fraction)
    check_limit(limit)
    numbers = babi_task_numbers(tasks, data_dir=data_dir)
    missing = [n for n in numbers if n not in available_tasks(variant, data_dir)]
    if missing and len(numbers) > 1:
        raise FileNotFoundError(
            f"the bAbI mix {'+'.join(map(str, numbers))} needs tasks {', '.join(map(str, missing))}, which the "
            f"{variant!r} folder lacks (it has {', '.join(map(str, available_tasks(variant, data_dir))) or 'none'}): "
            "read the mix from variant 'en' (data.babi_variant=en)")
    groups = [load_babi(number, split, variant=variant, data_dir=data_dir,
                        validation_fraction=validation_fraction, seed=seed).to_list()
              for number in numbers]
    rows = round_robin(groups)
    return to_dataset(rows if limit is None else rows[:limit])


def babi_stories(tasks: int | str | Sequence[int | str], variant: str = "en",
                 split: str = "train", *, data_dir: str | os.PathLike | None = None,
                 validation_fraction: float = 0.1, seed: int = 0,
                 prefixes: bool = False) -> list[str]:
    """The distinct story texts of one or several bAbI tasks, without questions or answers.

    A story's text is all its statements up to its last question (the context of that
    question). ``split`` picks the stories as `load_babi` does, so "train" leaves out the stories
    of the validation split of the same ``validation_fraction`` and ``seed``. With
    ``prefixes=True`` every question's context (each prefix of a story that a row uses) is
    included too. Tasks take turns as in `load_babi_mix`; duplicates are dropped, keeping the first
    occurrence.
    """
    check_split(split)
    _check_validation_fraction(validation_fraction)
    groups = []
    for number in babi_task_numbers(tasks, data_dir=data_dir):
        stories = parse_babi_file(babi_file(number, split, variant=variant, data_dir=data_dir))
        texts = []
        for index in _split_stories(len(stories), split, validation_fraction, seed):
            story = stories[index]
            contexts = [context for context, _, _ in story] if prefixes else [story[-1][0]]
            texts += [context for context in contexts if context]
        groups.append(texts)
    return list(dict.fromkeys(round_robin(groups)))



# ------------------------------------------------------------------------------------- registry

class BabiTask(Task):
    """``babi:N``, a mix ``babi:1+2`` or ``babi:all``: trained as one mix, reported task by task."""

    def __init__(self, numbers: tuple[int, ...], every: bool = False):
        self.numbers, self.every = numbers, every
        self.name = "babi:all" if every else "babi:" + "+".join(map(str, numbers))

    def parts(self) -> tuple[Task, ...]:
        return tuple(BabiTask((n,)) for n in self.numbers) if len(self.numbers) > 1 else (self,)

    def _tasks(self):
        return "all" if self.every else self.numbers

    def load(self, split: str, **kwargs) -> datasets.Dataset:
        if len(self.numbers) == 1 and not self.every:
            return load_babi(self.numbers[0], split, **kwargs)
        return load_babi_mix(self._tasks(), split, **kwargs)

    def config_key(self, split: str, *, variant: str = "en", data_dir=None, limit: int | None = None,
                   validation_fraction: float = 0.1, seed: int = 0) -> dict:
        """The bAbI file(s) by name and content hash (not location) and the split settings."""
        check_split(split)
        numbers = babi_task_numbers(self._tasks(), data_dir=data_dir)
        sources = [source_key(babi_file(n, split, variant=variant, data_dir=data_dir)) for n in numbers]
        key = {"variant": variant, "limit": limit, "validation_fraction": validation_fraction, "seed": seed}
        if len(numbers) == 1 and not self.every:
            key = {"task": f"babi-qa{numbers[0]}", "split": split, **key,
                   "source": sources[0][0], "source_sha256": sources[0][1]}
        else:
            key = {"task": "babi-qa" + "+qa".join(map(str, numbers)), "split": split, **key,
                   "source": [s for s, _ in sources], "source_sha256": [h for _, h in sources],
                   "mix": "round_robin"}
        if split == "test":  # the validation carve does not touch the test file
            del key["validation_fraction"], key["seed"]
        return key

    def training_kwargs(self, data, size: int, tokenizer=None, max_tokens: int | None = None, *,
                        text_limit: int | None = None) -> dict:
        return {"variant": data.babi_variant, "limit": size, "seed": data.seed}

    def eval_rows(self, limit: int | None, context: EvalTaskContext) -> EvalRows:
        (number,) = self.numbers
        if context.split == "test":
            rows = load_babi(number, "test", variant="en").to_list()
            what = f"bAbI en test file {babi_file(number, 'test', variant='en').name}"
        else:  # the stories the run held out of its training file (its variant and seed)
            variant, seed = babi_validation_source(context.task_settings)
            rows = load_babi(number, "validation", variant=variant, seed=seed).to_list()
            what = (f"bAbI {variant} validation stories of {babi_file(number, 'train', variant=variant).name} "
                    f"(seed {seed})")
        return EvalRows(rows if limit is None else rows[:limit], len(rows), what)

    def check_evaluable(self) -> None:
        check_test_files(self.name, babi_task_numbers(self._tasks()))


def babi_validation_source(task_settings: dict) -> tuple[str, int]:
    """The bAbI variant and seed whose train-file stories a run held out as validation (config.json
    ``task_settings``; "en" and 0 where a run recorded none)."""
    return task_settings.get("babi_variant") or "en", int(task_settings.get("seed", 0))


def check_test_files(task: str, numbers) -> None:
    """ValueError naming ``task`` unless every bAbI task of ``numbers`` has its ``en`` test file."""
    for number in numbers:
        try:
            babi_file(number, "test", variant="en")
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"task {task!r}: {e}") from None


@register_task("babi")
def _resolve_babi(name: str) -> Task:
    every = name.lower().endswith("all")
    return BabiTask(babi_task_numbers("all" if every else name), every=every)
