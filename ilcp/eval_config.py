"""Typed evaluation settings: what `ilcp.evaluation.run.evaluate` measures and how.

    from ilcp.eval_config import EvalConfig
    cfg = EvalConfig(tasks=["babi:2"], limit=50, lengths=[], out="results/default")

Every field is a declared setting (`ilcp.settings.setting`: help, bounds, choices) and
`__post_init__` checks the values against the declarations, so a bad setting is a one-line
ValueError before any model loads. This module imports
only the standard library, `ilcp.checks`, `ilcp.names` and `ilcp.engines.build` (``ilcp-eval`` builds it before
torch is imported); the method and task names are resolved by `evaluate`, which knows every family.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from .checks import check_key
from .settings import declared, setting
from .names import (DEFAULT_FACTS_COUNTS, DEFAULT_LATENCY_N, DEFAULT_LENGTHS, DEFAULT_LIMIT, DEFAULT_METHODS,
                    DEFAULT_THROUGHPUT_N, ENGINES, EVAL_SPLITS, PAYLOAD_DTYPES, PRECISIONS, split_task_names)
from .engines.build import DEFAULT_KV_CACHE_BYTES as DEFAULT_VLLM_KV_CACHE_BYTES


def _f(default, help: str, **bounds):
    """A declared setting (`ilcp.settings.setting`); a tuple default is a list per instance."""
    return setting(list(default) if isinstance(default, tuple) else default, help, **bounds)


def _names(value, name: str) -> list[str]:
    """A list of names from a list of them or one comma-separated string (task names keep a file
    task's per-split commas: `ilcp.names.split_task_names`)."""
    if isinstance(value, str):
        if name == "tasks":
            return split_task_names(value)
        return [part.strip() for part in value.split(",") if part.strip()]
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list of names or a comma-separated string, got {value!r}") from None
    return items


def _int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _ints(name: str, value, low: int) -> list[int]:
    if isinstance(value, (str, bytes)):
        raise ValueError(f"{name} must be a list of ints >= {low}, got {value!r}")
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list of ints >= {low}, got {value!r}") from None
    return [_int(name, v, low) for v in items]


@dataclass
class EvalConfig:
    tasks: list = _f([], "tasks besides the run's own training task ('babi:N', 'babi:all', 'facts', 'facts-heldout', "
                         "'babilong:N:LENGTH', 'squad', 'jsonl:PATH' and the other file forms), reported separately "
                         "(a mix task by task) and marked held out unless trained on")
    only_tasks: bool = _f(False, "evaluate only ``tasks``, not the run's training task (e.g. one long-context "
                                 "task of a run trained on short contexts)")
    methods: list = _f(list(DEFAULT_METHODS), "method names and groups (ilcp.evaluation.registry.make_method); those "
                                              "whose weights the run lacks are skipped with a note")
    split: str = _f("test", "whose questions every task asks: 'test', or 'validation' (to choose between runs or "
                            "settings without reading the test split)", choices=EVAL_SPLITS)
    limit: int | None = _f(DEFAULT_LIMIT, "questions per task, the first of the split (None or 0: all)", minimum=1)
    latency_n: int = _f(DEFAULT_LATENCY_N, "requests timed one at a time per method and task (0: no latency)",
                        minimum=0)
    batch_size: int = _f(8, "greedy-decoding batch size of the accuracy pass", minimum=1)
    max_new_tokens: int = _f(8, "answer token budget", minimum=1)
    lengths: list = _f(list(DEFAULT_LENGTHS), "target context lengths in tokens of the time-to-first-token sweep "
                                              "(empty: no sweep)")
    length_n: int = _f(3, "requests per length and method in the context-length sweep", minimum=1)
    facts_counts: list = _f(list(DEFAULT_FACTS_COUNTS), "numbers of facts of the accuracy sweep of a facts-trained "
                                                        "run (empty: no sweep)")
    facts_count_limit: int = _f(50, "questions per number of facts in the facts-count sweep", minimum=1)
    seed: int = _f(0, "seed of the facts contexts in the context-length sweep", minimum=0)
    out: str | os.PathLike | None = _f(None, "folder for results.json, results.md, predictions.jsonl and the plots "
                                             "(None: nothing written)")
    device: str | None = _f(None, "where a loaded LM runs (default: cuda when available, else cpu)")
    progress: bool = _f(False, "show progress bars")
    payload_dtype: str = _f("float32", "dtype of the ilcp latent on the wire: float32, float16, bfloat16 or int8 "
                                       "(wire and tensor bytes are those of the packed payload)", choices=PAYLOAD_DTYPES)
    engine: str = _f("hf", "the receiver's decoder: 'hf', or 'vllm' (every prefix decoded by HF and through one "
                           "vLLM engine, with both engines' accuracy and their agreement)", choices=ENGINES)
    throughput_batches: list = _f([], "batch sizes of the receiver-throughput benchmark: questions per second of "
                                      "the decode of ilcp's and cold_read's prefixes, HF and (engine=vllm) vLLM "
                                      "(empty: none)")
    throughput_n: int = _f(DEFAULT_THROUGHPUT_N, "questions of the first task decoded per throughput cell", minimum=1)
    vllm_kv_cache_bytes: int = _f(DEFAULT_VLLM_KV_CACHE_BYTES, "the vLLM engine's KV cache in bytes", minimum=1)
    precision: str | None = _f(None, "compute precision of the HF forwards: 32-true, bf16-mixed or auto (None: the "
                                     "one the run trained at)", choices=PRECISIONS)
    resume: bool = _f(False, "reuse the (task, method) results that an earlier evaluation of the same run with the "
                             "same settings saved under out/parts, and compute only the missing ones")
    export_key: bytes | None = field(default=None, repr=False, metadata={
        "help": "the key the export was signed with (ilcp.export.sign_export; bytes, >= 16): config.json's signature "
                "must verify under it, as from_pretrained(export_key=) checks it (None: the export is read "
                "unverified; its digests catch accidents, not edits)"})

    def __post_init__(self):
        self.tasks = _names(self.tasks, "tasks")
        self.methods = _names(self.methods, "methods")
        if not self.methods:
            raise ValueError("no methods given")
        if self.only_tasks and not self.tasks:
            raise ValueError("only_tasks needs tasks: name the tasks to evaluate")
        bad = [m for m in self.tasks + self.methods if not isinstance(m, str)]
        if bad:
            raise ValueError(f"tasks and methods must be names (strings), got {bad[0]!r}")
        if self.limit == 0:
            self.limit = None
        for d in declared(self):  # the declared bounds and choices
            value = getattr(self, d.name)
            if value is None and d.nullable:
                continue
            if d.meta.get("minimum") is not None:
                _int(d.name, value, d.meta["minimum"])
            if d.meta.get("choices") is not None and value not in d.meta["choices"]:
                raise ValueError(f"{d.name} must be one of {', '.join(d.meta['choices'])}, got {value!r}")
        self.throughput_batches = _ints("throughput_batches", self.throughput_batches, 1)
        self.lengths = _ints("lengths", self.lengths, 1)
        self.facts_counts = _ints("facts_counts", self.facts_counts, 1)
        for name in ("progress", "resume"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.resume and self.out is None:
            raise ValueError("resume reads the results saved under out: give out")
        if self.export_key is not None:
            self.export_key = check_key(self.export_key)

    @classmethod
    def help(cls) -> dict[str, str]:
        """Each field's help text, by name."""
        return {f.name: f.metadata["help"] for f in fields(cls)}
