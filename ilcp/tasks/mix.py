"""A mix of tasks of any sources: ``mix:squad|babi:all`` (parts separated by ``|``).

Each part is resolved by its own source and a mix of mixes is flattened to single tasks (``babi:all``
is its fifteen tasks), so eval reports a mix task by task. A mix is balanced as ``babi:all`` is:
the same number of rows from every part (ceil(limit / parts)), taken in turn (`round_robin`), so
any prefix of the rows mixes the parts equally. Row ids are prefixed with their part's name, so
that two sources' ids never meet. `without` gives the mix with named parts held out, the training
task of ``data.heldout_tasks``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import datasets

from .base import check_split, round_robin, to_dataset
from .registry import Task, register_task, resolve_task

__all__ = ["MixTask", "held_out"]

SEPARATOR = "|"


class MixTask(Task):
    """Single tasks of any sources, trained as one balanced mix and reported one by one."""

    def __init__(self, parts: Sequence[Task]):
        singles: list[Task] = []
        for part in parts:
            singles += [p for p in part.parts() if p not in singles]
        if len(singles) < 2:
            raise ValueError(f"a mix needs two tasks or more, got {[p.name for p in singles]}")
        self._parts = tuple(singles)
        self.name = "mix:" + SEPARATOR.join(p.name for p in singles)
        self.open_answers = all(p.open_answers for p in singles)

    def parts(self) -> tuple[Task, ...]:
        return self._parts

    def load(self, split: str, *, limit: int | None = None, parts: dict | None = None) -> datasets.Dataset:
        check_split(split)
        groups = []
        for part in self._parts:
            kwargs = dict((parts or {}).get(part.name, {}))
            rows = part.load(split, **kwargs).to_list()
            groups.append([{**row, "id": f"{part.name}/{row['id']}"} for row in rows])
        rows = round_robin(groups)
        return to_dataset(rows if limit is None else rows[:limit])

    def config_key(self, split: str, *, limit: int | None = None, parts: dict | None = None) -> dict:
        return {"mix": [part.config_key(split, **dict((parts or {}).get(part.name, {}))) for part in self._parts],
                "split": split, "limit": limit, "order": "round_robin"}

    def training_kwargs(self, data, size: int, tokenizer=None, max_tokens: int | None = None, *,
                        text_limit: int | None = None) -> dict:
        each = math.ceil(size / len(self._parts))
        return {"limit": size, "parts": {p.name: p.training_kwargs(data, each, tokenizer, max_tokens, text_limit=text_limit)
                                         for p in self._parts}}

    def task_settings(self, data) -> dict:
        settings: dict = {}
        for part in self._parts:
            settings.update(part.task_settings(data))
        return settings

    def check_trainable(self) -> None:
        for part in self._parts:
            part.check_trainable()

    def check_evaluable(self) -> None:
        for part in self._parts:
            part.check_evaluable()


def held_out(task: Task, names: Sequence[str]) -> Task:
    """`task` without the parts `names` (each a single task of it): the task a run trains on when
    ``data.heldout_tasks`` holds them out. A bAbI or BABILong mix stays one (``babi:1+4+...``);
    another mix becomes the ``mix:`` of the rest.

    Raises:
        ValueError: a name that is no task, a mix, a task that is not one of `task`'s, or every
            part held out (one line naming the entry).
    """
    if not names:
        return task
    parts = {p.name: p for p in task.parts()}
    held: set[str] = set()
    for name in names:
        try:
            single = resolve_task(name)
        except ValueError as e:
            raise ValueError(f"data.heldout_tasks: {e}") from None
        if len(single.parts()) > 1:
            raise ValueError(f"data.heldout_tasks: {name!r} is a mix: name its tasks one by one "
                             f"({', '.join(p.name for p in single.parts())})")
        if single.name not in parts:
            raise ValueError(f"data.heldout_tasks: {name!r} is not one of the tasks {task.name!r} trains on "
                             f"({', '.join(parts)})")
        held.add(single.name)
    kept = [p for name, p in parts.items() if name not in held]
    if not kept:
        raise ValueError(f"data.heldout_tasks holds out every task of {task.name!r}: nothing is left to train on")
    if len(kept) == 1:
        return kept[0]
    same_source = _same_source_mix([p.name for p in kept])
    return resolve_task(same_source) if same_source else MixTask(kept)


def _same_source_mix(names: list[str]) -> str | None:
    """The name of the bAbI mix (``babi:1+4``) or BABILong mix (``babilong:1+8:0.5k``) of these single
    tasks, which balances them as that source does; None when they are no such set."""
    babi = [re.fullmatch(r"babi:(\d+)", name) for name in names]
    if all(babi):
        return "babi:" + "+".join(m.group(1) for m in babi)
    babilong = [re.fullmatch(r"babilong:(\d+):(.+)", name) for name in names]
    if all(babilong) and len({m.group(2) for m in babilong}) == 1:
        return f"babilong:{'+'.join(m.group(1) for m in babilong)}:{babilong[0].group(2)}"
    return None


@register_task("mix")
def _resolve_mix(name: str) -> Task:
    body = name.split(":", 1)[1]
    names = [part.strip() for part in body.split(SEPARATOR)]
    if any(not part for part in names):
        raise ValueError(f"a mix names its tasks separated by {SEPARATOR!r}, got {name!r}")
    if any(part.lower().startswith("mix:") for part in names):
        raise ValueError(f"a mix cannot hold a mix: {name!r}")
    return MixTask([resolve_task(part) for part in names])
