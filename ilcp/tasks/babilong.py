"""``babilong:<task>:<length>`` rows (`ilcp.tasks.babilong_context` builds the contexts): the rows of bAbI task
``<task>``, each story's sentences spread, in order, through public-domain prose until the context
is ``<length>`` tokens of the LM's tokenizer (``0``, ``0.5k``, ``1k``, ``2k``, ``4k`` or a number).
A mix (``babilong:1+7+8:0.5k``) interleaves its tasks' rows in proportion to their sizes; eval
reads a mix's tasks one by one."""

from __future__ import annotations

import os

from ..names import BabilongTask, length_label, parse_babilong_name
from .babilong_context import GENERATOR_VERSION, babilong_context, story_sentences, tokenizer_key
from .background import background_key
from .babi import babi_file, babi_validation_source, check_test_files, load_babi
from .base import check_limit, check_split, interleave, source_key, to_dataset
from .registry import EvalTaskContext, EvalRows, Task, register_task


def _babi(task: BabilongTask, name: str, split: str, variant: str, data_dir):
    """The bAbI file of a BABILong task's split; ValueError (not FileNotFoundError) without one."""
    try:
        return babi_file(task.number, split, variant=variant, data_dir=data_dir)
    except FileNotFoundError as e:
        raise ValueError(f"BABILong task {name!r}: {e}") from None


def load_babilong(name: str, split: str, *, tokenizer=None, variant: str = "en",
                  data_dir: str | os.PathLike | None = None, limit: int | None = None,
                  validation_fraction: float = 0.1, seed: int = 0,
                  background_dir: str | os.PathLike | None = None):
    """Rows (a `datasets.Dataset` with ``ilcp.tasks.TASK_COLUMNS``) of ``"babilong:<task>:<length>"``.

    The rows of `ilcp.tasks.load_babi` for the same arguments (so the validation split is carved
    from the train file by whole stories, and ``limit`` keeps the first N), each context rebuilt
    by `babilong_context` with the split's background and the seed ``"<seed>/<bAbI row id>"``.
    Row ids: ``babilong-qa{N}-{length}`` followed by the bAbI id's tail (``-test-s0-q0``).
    """
    task = parse_babilong_name(name)
    if task.length > 0 and tokenizer is None:
        raise ValueError(f"BABILong task {name!r} counts its length in the LM's tokens: pass "
                         "tokenizer= (the LM's tokenizer)")
    if len(task.numbers) > 1:
        return to_dataset(_babilong_mix(
            task, name, split, lambda part, count: load_babilong(
                part, split, tokenizer=tokenizer, variant=variant, data_dir=data_dir, limit=count,
                validation_fraction=validation_fraction, seed=seed, background_dir=background_dir).to_list(),
            variant=variant, data_dir=data_dir, limit=limit, validation_fraction=validation_fraction, seed=seed))
    _babi(task, name, split, variant, data_dir)
    rows = load_babi(task.number, split, variant=variant, data_dir=data_dir, limit=limit,
                     validation_fraction=validation_fraction, seed=seed).to_list()
    babi_prefix = f"babi-qa{task.number}"
    for row in rows:
        row["context"] = babilong_context(story_sentences(row["context"]), task.length, tokenizer,
                                          split=split, seed=f"{seed}/{row['id']}",
                                          background_dir=background_dir)
        row["id"] = task.name + row["id"][len(babi_prefix):]
        row["task"] = task.name
    return to_dataset(rows)


def babilong_stories(name: str, split: str, *, variant: str = "en",
                     data_dir: str | os.PathLike | None = None, limit: int | None = None,
                     validation_fraction: float = 0.1, seed: int = 0, **_ignored) -> list[list[str]]:
    """The bAbI story (its sentences, in order) behind each row `load_babilong` gives for the same
    arguments, row for row; other keyword arguments of `load_babilong` are accepted and ignored.
    With `ilcp.tasks.babilong_context.story_token_mask` it says which context tokens are the story's: a
    training signal only (the sender is never told)."""
    task = parse_babilong_name(name)
    if len(task.numbers) > 1:
        return _babilong_mix(
            task, name, split, lambda part, count: babilong_stories(
                part, split, variant=variant, data_dir=data_dir, limit=count,
                validation_fraction=validation_fraction, seed=seed),
            variant=variant, data_dir=data_dir, limit=limit, validation_fraction=validation_fraction, seed=seed)
    _babi(task, name, split, variant, data_dir)
    rows = load_babi(task.number, split, variant=variant, data_dir=data_dir, limit=limit,
                     validation_fraction=validation_fraction, seed=seed)
    return [story_sentences(context) for context in rows["context"]]


def _babilong_mix(task: BabilongTask, name: str, split: str, build, *, limit: int | None, **babi_kwargs) -> list:
    """The items of a BABILong mix in the order `load_babi_mix` gives a bAbI mix: ``build(part,
    count)`` gives a task's first ``count`` items (rows or stories), and only as many of each
    task's as ``limit`` keeps are built."""
    check_limit(limit)
    sizes = []
    for number in task.numbers:
        _babi(task._replace(number=number), name, split, babi_kwargs["variant"], babi_kwargs["data_dir"])
        sizes.append(len(load_babi(number, split, **babi_kwargs)))
    order = interleave([[(g, i) for i in range(size)] for g, size in enumerate(sizes)])
    order = order if limit is None else order[:limit]
    counts = [0] * len(sizes)
    for g, i in order:
        counts[g] = max(counts[g], i + 1)
    groups = [build(part, count) for part, count in zip(task.parts, counts, strict=True)]
    return [groups[g][i] for g, i in order]


def babilong_config_key(name: str, split: str, *, tokenizer=None, variant: str = "en",
                        data_dir: str | os.PathLike | None = None, limit: int | None = None,
                        validation_fraction: float = 0.1, seed: int = 0,
                        background_dir: str | os.PathLike | None = None) -> dict:
    """What `load_babilong` builds for these arguments, JSON-serialisable: the canonical task,
    its settings, the bAbI file and its hash, the background files and their hash, the
    tokenizer (`tokenizer_key`; None for length 0) and ``GENERATOR_VERSION``."""
    task = parse_babilong_name(name)
    check_split(split)
    if task.length > 0 and tokenizer is None:
        raise ValueError(f"BABILong task {name!r} counts its length in the LM's tokens: pass "
                         "tokenizer= (the LM's tokenizer)")
    if len(task.numbers) > 1:  # each task's own key (every row of it), then the mix's limit
        return {"task": task.name, "limit": limit,
                "parts": [babilong_config_key(part, split, tokenizer=tokenizer, variant=variant, data_dir=data_dir,
                                              validation_fraction=validation_fraction, seed=seed,
                                              background_dir=background_dir) for part in task.parts]}
    source, sha256 = source_key(_babi(task, name, split, variant, data_dir))
    key = {"task": task.name, "split": split, "length_tokens": task.length, "variant": variant,
           "limit": limit, "validation_fraction": validation_fraction, "seed": seed,
           "source": source, "source_sha256": sha256, **background_key(background_dir),
           "tokenizer": tokenizer_key(tokenizer) if task.length > 0 else None,
           "generator_version": GENERATOR_VERSION}
    if split == "test":  # the validation carve does not touch the test file
        del key["validation_fraction"]
    return key




# ------------------------------------------------------------------------------------- registry

class BabilongTaskEntry(Task):
    """``babilong:N:LENGTH`` (or a mix ``babilong:1+7+8:0.5k``, reported task by task)."""

    def __init__(self, name: str):
        self.parsed = parse_babilong_name(name)  # its ValueError names the problem
        numbers = "+".join(map(str, self.parsed.numbers))
        self.name = f"babilong:{numbers}:{length_label(self.parsed.length)}"

    def parts(self) -> tuple[Task, ...]:
        return tuple(BabilongTaskEntry(part) for part in self.parsed.parts) if len(self.parsed.numbers) > 1 else (self,)

    def load(self, split: str, **kwargs):
        return load_babilong(self.name, split, **kwargs)

    def config_key(self, split: str, **kwargs) -> dict:
        return babilong_config_key(self.name, split, **kwargs)

    def stories(self, split: str, **kwargs) -> list[list[str]]:
        return babilong_stories(self.name, split, **kwargs)

    def training_kwargs(self, data, size: int, tokenizer=None, max_tokens: int | None = None, *,
                        text_limit: int | None = None) -> dict:
        return {"variant": data.babi_variant, "limit": size, "seed": data.seed, "tokenizer": tokenizer}

    def eval_rows(self, limit: int | None, context: EvalTaskContext) -> EvalRows:
        number, length, split = self.parsed.number, self.parsed.length, context.split
        variant, seed = ("en", 0) if split == "test" else babi_validation_source(context.task_settings)
        available = len(load_babi(number, split, variant=variant, seed=seed))
        rows = load_babilong(self.name, split, tokenizer=context.tokenizer, variant=variant, seed=seed,
                             limit=limit).to_list()
        stories = (f"bAbI en test file {babi_file(number, 'test', variant='en').name}" if split == "test" else
                   f"bAbI {variant} validation stories of {babi_file(number, 'train', variant=variant).name}")
        desc = (f"{stories} in {length}-token contexts of {split} background (ilcp.tasks.babilong_context, "
                f"seed {seed})")
        return EvalRows(rows, available, desc)

    def check_evaluable(self) -> None:
        check_test_files(self.name, self.parsed.numbers)


@register_task("babilong")
def _resolve_babilong(name: str) -> Task:
    return BabilongTaskEntry(name)
