"""Handoff tasks as `datasets.Dataset` rows with the columns ``TASK_COLUMNS``: ``id``, ``task``,
``context``, ``question``, ``answer`` (the training target) and ``answers`` (every accepted
answer, the target first).

Every task name resolves through one registry (`resolve_task`), one module per source:

- `ilcp.tasks.babi`: bAbI files (``babi:N``, a balanced mix ``babi:1+2+3``, ``babi:all``);
- `ilcp.tasks.facts`: the procedural facts generator (``facts``, eval's ``facts-heldout``), its
  words in `ilcp.tasks.fact_vocabulary`;
- `ilcp.tasks.babilong`: bAbI stories in long prose (``babilong:N:LENGTH``), the contexts built by
  `ilcp.tasks.babilong_context` from the prose of `ilcp.tasks.background`;
- `ilcp.tasks.files`: a user's own files (``jsonl:PATH``, ``csv:PATH``, ``parquet:PATH``,
  ``disk:PATH``), read by `datasets`;
- `ilcp.tasks.squad`: the shipped SQuAD v1.1 subset (``squad``);
- `ilcp.tasks.mix`: a balanced mix of tasks of any sources (``mix:squad|babi:all``), and
  `held_out` (a task without the parts ``data.heldout_tasks`` names).

    from ilcp.tasks import load_task, resolve_task, task_config_key
    test = load_task("babi:1", "test", limit=100)
    train = load_task("babi:all", "train", variant="en", limit=1500)    # 100 rows of each of 15 tasks
    facts = load_task("facts", "train", n_examples=500, n_facts=4, n_distractors=20)
    mine = load_task("jsonl:notes.jsonl", "train", columns={"context": "passage"})
    key = task_config_key("babi:1", "test")          # JSON-serialisable; part of a cache key
    long = load_task("babilong:1:2k", "test", tokenizer=lm.tokenizer)
    [t.name for t in resolve_task("babi:1+2").parts()]   # eval reports a mix task by task
"""

from .base import SPLITS, TASK_COLUMNS, TaskFormatError
from .registry import EvalTaskContext, EvalRows, Task, load_task, register_task, resolve_task, task_config_key, task_syntax

# Each source registers itself on import, in this order.
from .babi import (BABI_DIR_ENV, BabiTask, available_tasks, babi_data_dir, babi_file, babi_stories,  # noqa: E402
                   babi_task_numbers, default_babi_dir, load_babi, load_babi_mix, parse_babi_file)
from .fact_vocabulary import (ALL_ENTITIES, BASE_ENTITIES, FACT_ATTRIBUTE_VOCABULARY, FACT_ATTRIBUTES,  # noqa: E402
                              FACT_VOCABULARIES, HELDOUT_FRACTION, VALUE_SPLITS, FactAttribute, fact_values)
from .facts import (FACTS_TEST_SIZE, FACTS_VALUE_SPLIT_VERSION, FACTS_VERSION, FactsTask, count_tokens,  # noqa: E402
                    facts_contexts, facts_for_length, make_facts)
from .babilong import BabilongTaskEntry, babilong_config_key, babilong_stories, load_babilong  # noqa: E402
from .squad import SquadTask, squad_dir  # noqa: E402
from .files import FileTask, file_config_key, load_files  # noqa: E402
from .mix import MixTask, held_out  # noqa: E402

__all__ = [
    "ALL_ENTITIES", "BABI_DIR_ENV", "BASE_ENTITIES", "EvalTaskContext", "EvalRows", "FACTS_TEST_SIZE",
    "FACTS_VALUE_SPLIT_VERSION", "FACTS_VERSION", "FACT_ATTRIBUTES", "FACT_ATTRIBUTE_VOCABULARY",
    "FACT_VOCABULARIES", "FactAttribute", "HELDOUT_FRACTION", "SPLITS", "TASK_COLUMNS", "Task", "TaskFormatError",
    "VALUE_SPLITS", "BabiTask", "BabilongTaskEntry", "FactsTask", "FileTask", "MixTask", "SquadTask", "available_tasks",
    "babi_data_dir", "babi_file", "babi_stories", "babi_task_numbers", "babilong_config_key", "babilong_stories",
    "count_tokens", "default_babi_dir", "fact_values", "facts_contexts", "facts_for_length", "file_config_key",
    "held_out",
    "load_babi", "load_babi_mix", "load_babilong", "load_files", "load_task", "make_facts", "parse_babi_file",
    "register_task",
    "resolve_task", "squad_dir", "task_config_key", "task_syntax",
]
