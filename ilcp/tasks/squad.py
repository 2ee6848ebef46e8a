"""``squad``: a reading-comprehension subset of SQuAD v1.1 (Rajpurkar et al. 2016, CC BY-SA 4.0)
shipped in ``data/squad`` (its README and SOURCE.md give the licence, the source and the recipe,
scripts/build_squad.py): 3,004 / 308 / 506 questions from the v1.1 training set, split by
Wikipedia article so that no article is in two splits; every answer the set gives a question is an
accepted answer (one per question in the training set). Read as a file task (one JSON Lines file
per split) and scored as SQuAD scores it (exact match and F1, ``open_answers``)."""

from __future__ import annotations

from pathlib import Path

import datasets

from ..datadir import data_root
from .base import SPLITS, check_split, to_dataset
from .files import FileTask, file_config_key, load_files
from .registry import EvalTaskContext, EvalRows, Task, register_task


def squad_dir() -> Path:
    return data_root() / "squad"


def squad_name() -> str:
    """The file-task name of the shipped subset (one JSON Lines file per split)."""
    folder = squad_dir()
    return "jsonl:" + ",".join(f"{split}={folder / f'{split}.jsonl'}" for split in SPLITS)


class SquadTask(FileTask):
    def __init__(self):
        super().__init__(squad_name())
        self.name = "squad"

    def load(self, split: str, **kwargs) -> datasets.Dataset:
        check_split(split)
        kwargs.pop("columns", None)
        rows = load_files(squad_name(), split, **kwargs).to_list()
        for row in rows:
            row["task"] = "squad"
        return to_dataset(rows)

    def config_key(self, split: str, **kwargs) -> dict:
        kwargs.pop("columns", None)
        return {**file_config_key(squad_name(), split, **kwargs), "task": "squad"}

    def training_kwargs(self, data, size: int, tokenizer=None, max_tokens: int | None = None, *,
                        text_limit: int | None = None) -> dict:
        return {"limit": size, "tokenizer": tokenizer, "max_tokens": max_tokens}

    def task_settings(self, data) -> dict:
        return {}

    def eval_rows(self, limit: int | None, context: EvalTaskContext) -> EvalRows:
        split = context.split
        rows = self.load(split, tokenizer=context.tokenizer, max_tokens=context.max_tokens).to_list()
        return EvalRows(rows if limit is None else rows[:limit], len(rows),
                        f"SQuAD v1.1 subset, {split} split (data/squad/{split}.jsonl: articles of no other split)")


@register_task("squad")
def _resolve_squad(name: str) -> Task:
    return SquadTask()
