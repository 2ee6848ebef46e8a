"""One registry of task names: train, eval and the sweep resolve every name through `resolve_task`.

A source registers once (`register_task`) a function that turns a name into a `Task`: the
canonical name, the single tasks a mix is reported as, whether its answers are open text, how to
load a split, its cache key and what training and eval pass to the loader. The names a source
takes are its pattern in ``ilcp.names.TASK_NAMES`` (there so configs check a name without
importing `datasets`); a test checks that every pattern has its source registered.

    from ilcp.tasks import resolve_task
    task = resolve_task("babi-qa1")        # Task "babi:1"
    task.load("test", limit=100)           # a datasets.Dataset with TASK_COLUMNS
    [t.name for t in resolve_task("babi:1+2").parts()]   # ["babi:1", "babi:2"]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import datasets

from ..names import TASK_NAMES, task_source, unknown_task
from .base import check_split


@dataclass(frozen=True)
class EvalTaskContext:
    """What eval knows when it builds a task's rows: the split asked (``split``: "test" or
    "validation"), the LM's tokenizer and token limit for a
    context (None where the sender cuts long contexts) and for a question or answer, the run's recorded task settings (config.json
    ``task_settings``) and facts settings (`ilcp.evaluation.run.run_facts_settings`), and the
    training task's name."""

    tokenizer: object = None
    split: str = "test"
    max_tokens: int | None = None
    text_limit: int | None = None  # the LM's positions: no question or answer may be longer
    task_settings: dict = field(default_factory=dict)
    facts_settings: dict | None = None
    train_task: str | None = None


@dataclass(frozen=True)
class EvalRows:
    rows: list[dict]
    available: int  # questions in the whole split
    source: str  # what the rows were built from, for results.json


class Task:
    """A resolved task name. Subclasses implement `load` and `config_key`; the others have
    defaults that fit a single task with closed answers."""

    name: str = ""
    open_answers: bool = False  # answers are open text: scored with SQuAD's EM and F1 over every accepted answer
    needs_facts_settings: bool = False  # eval needs the run's facts settings to rebuild it
    trainable: bool = True  # eval-only tasks (facts-heldout) are refused by training

    def parts(self) -> tuple[Task, ...]:
        """The single tasks eval reports a mix as (itself for a single task)."""
        return (self,)

    def load(self, split: str, **kwargs) -> datasets.Dataset:
        raise NotImplementedError

    def config_key(self, split: str, **kwargs) -> dict:
        raise NotImplementedError

    def training_kwargs(self, data, size: int, tokenizer=None, max_tokens: int | None = None, *,
                        text_limit: int | None = None) -> dict:
        """`load` arguments for a training split of ``size`` rows (``data``: `ilcp.config_sections.DataConfig`)."""
        return {"limit": size}

    def task_settings(self, data) -> dict:
        """What the export records beyond the common ``task_settings`` to rebuild this task in eval."""
        return {}

    def eval_rows(self, limit: int | None, context: EvalTaskContext) -> EvalRows:
        """The rows of ``context.split`` (the first ``limit``) and what eval reports of their source."""
        rows = self.load(context.split).to_list()
        return EvalRows(rows if limit is None else rows[:limit], len(rows), self.name)

    def check_evaluable(self) -> None:
        """Raise ValueError if eval cannot read this task (checked before the LM loads)."""

    def check_trainable(self) -> None:
        """Raise ValueError if training cannot read this task (checked before the LM loads)."""
        if not self.trainable:
            raise ValueError(f"task {self.name!r} is for evaluation only")

    def __repr__(self) -> str:
        return f"Task({self.name!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Task) and type(other) is type(self) and other.name == self.name

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.name))


_RESOLVERS: dict[str, Callable[[str], Task]] = {}


def register_task(source: str):
    """Register the resolver ``(name) -> Task`` of a task source: the names it takes are
    ``ilcp.names.TASK_NAMES[source]``'s pattern (kept there so configs check names without
    importing `datasets`)."""
    if source not in TASK_NAMES:
        raise ValueError(f"task source {source!r} has no entry in ilcp.names.TASK_NAMES")

    def decorate(resolve: Callable[[str], Task]):
        if source in _RESOLVERS:
            raise ValueError(f"task source {source!r} registered twice")
        _RESOLVERS[source] = resolve
        return resolve

    return decorate


def task_syntax() -> str:
    """Every source's name forms, for help texts and errors."""
    return "; ".join(forms for _, forms in TASK_NAMES.values())


def task_sources() -> tuple[str, ...]:
    """The registered sources, in the order `ilcp.names.TASK_NAMES` tries them."""
    return tuple(source for source in TASK_NAMES if source in _RESOLVERS)


def resolve_task(name: str | Sequence[str] | Task) -> Task:
    """The `Task` a name stands for; ValueError naming the forms for an unknown name. A list of bAbI
    names is a mix (``["babi:1", "babi:2"]`` is ``babi:1+2``)."""
    if isinstance(name, Task):
        return name
    if isinstance(name, (list, tuple)):
        name = "babi:" + "+".join(str(part).split(":")[-1] for part in name)
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"a task name must be a non-empty string, got {name!r}")
    problem = unknown_task(name)
    if problem is not None:
        raise ValueError(problem)
    return _RESOLVERS[task_source(name)](name.strip())


def load_task(name, split: str, **kwargs) -> datasets.Dataset:
    """Rows for a named task and split (the source's loader's keyword arguments)."""
    check_split(split)
    return resolve_task(name).load(split, **kwargs)


def task_config_key(name, split: str, **kwargs) -> dict:
    """A JSON-serialisable description of what `load_task` builds for these arguments (content
    hashes of the source files, not their locations), for cache keys."""
    check_split(split)
    return resolve_task(name).config_key(split, **kwargs)
