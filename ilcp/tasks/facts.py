"""``facts``: procedural stories of short facts about named things ("Cedar is owned by Alice.")
and one question about one of them ("Who owns Cedar?").

The context length is dialled with ``n_facts`` and ``n_distractors``; `facts_for_length` picks them
for a target token count.

Held-out values: ``value_split="train"`` or ``"heldout"`` (a keyword of `make_facts`, so also of
`load_task("facts", ...)`) switches to the larger vocabularies ``FACT_VOCABULARIES`` (people,
cities, years, colours), each partitioned once and for all by a fixed hash into train values and
held-out values (``HELDOUT_FRACTION`` of each vocabulary). With ``value_split="train"`` (for the
train, validation and test splits) every value in a context (the asked answer, the other facts,
the filler sentences) is a train value; ``value_split="heldout"`` exists only for the test split,
and every value in its contexts is a held-out value, so its answers never occur anywhere in
training data made with ``value_split="train"``. Both modes never repeat a (context, question)
pair within or across splits, and draw entities from ``ALL_ENTITIES``. The default
``value_split=None`` is the original generator, row for row (it may repeat rows when its small
space is exhausted, e.g. ``n_facts=1`` and many rows). `facts_contexts` gives unlabelled contexts
of either value split for reconstruction pretraining.

Task names: ``facts`` (the run's settings), ``facts-heldout`` (eval only: the test split whose
values training never used).
"""

from __future__ import annotations

import inspect
import math
import random
import zlib

import datasets

from ..checks import positive_int
from .base import check_split, to_dataset
from .fact_vocabulary import (ALL_ENTITIES, BASE_ENTITIES, FACT_ATTRIBUTE_VOCABULARY, FACT_ATTRIBUTES, FACT_VOCABULARIES,
                              VALUE_PARTITION, check_value_split, filler_sentence)
from .registry import EvalTaskContext, EvalRows, Task, register_task

# Bump when make_facts would produce different rows for the same arguments.
FACTS_VERSION = 1
# Bump when make_facts with a value_split, or the value vocabularies and their partition, change.
FACTS_VALUE_SPLIT_VERSION = 1

# ---------------------------------------------------------------------------------------- facts

# Which split an asked (entity, attribute, value) belongs to: by hash, so no split asks a fact
# that another split asks.
_SPLIT_BUCKETS = {"train": range(0, 8), "validation": range(8, 9), "test": range(9, 10)}


def _facts_example(rng: random.Random, split: str, n_facts: int, n_distractors: int) -> tuple:
    pool = BASE_ENTITIES if n_facts + n_distractors <= 2 * len(BASE_ENTITIES) else ALL_ENTITIES
    attributes = tuple(FACT_ATTRIBUTES)
    while True:  # the asked fact, from this split's share of all facts
        entity, attribute = rng.choice(pool), rng.choice(attributes)
        value = rng.choice(FACT_ATTRIBUTES[attribute].values)
        if zlib.crc32(f"{entity}|{attribute}|{value}".encode()) % 10 in _SPLIT_BUCKETS[split]:
            break
    n_entities = rng.randint(math.ceil(n_facts / len(attributes)), min(n_facts, len(pool)))
    entities = [entity] + rng.sample([e for e in pool if e != entity], n_entities - 1)
    candidates = [(e, a) for e in entities for a in attributes if (e, a) != (entity, attribute)]
    pairs = [(entity, attribute)] + rng.sample(candidates, n_facts - 1)
    n_entity_distractors = sum(rng.random() < 0.5 for _ in range(n_distractors))
    taken = set(entities)
    others = [(e, a) for e in pool if e not in taken for a in attributes]
    pairs += rng.sample(others, min(n_entity_distractors, len(others)))
    sentences = [FACT_ATTRIBUTES[attribute].statement.format(entity=entity, value=value)]
    sentences += [FACT_ATTRIBUTES[a].statement.format(
        entity=e, value=rng.choice(FACT_ATTRIBUTES[a].values)) for e, a in pairs[1:]]
    seen = set()
    for _ in range(n_distractors - (len(pairs) - n_facts)):
        sentence = filler_sentence(rng)
        for _retry in range(20):
            if sentence not in seen:
                break
            sentence = filler_sentence(rng)
        seen.add(sentence)
        sentences.append(sentence)
    rng.shuffle(sentences)
    question = FACT_ATTRIBUTES[attribute].question.format(entity=entity)
    return " ".join(sentences), question, value


def _asked_bucket(entity: str, attribute: str, value: str) -> int:
    return zlib.crc32(f"{entity}|{attribute}|{value}".encode()) % 10


def _distinct_draws(rng: random.Random, draw, count: int, exclude: set) -> list:
    """``count`` distinct results of ``draw()`` not in ``exclude``, in the order drawn."""
    taken, out = set(exclude), []
    while len(out) < count:
        item = draw()
        if item not in taken:
            taken.add(item)
            out.append(item)
    return out


def _value_split_example(rng: random.Random, split: str, n_facts: int, n_distractors: int,
                         value_split: str) -> tuple:
    """One (context, question, answer) whose every value is from ``value_split``'s share."""
    side = {name: VALUE_PARTITION[name][value_split] for name in FACT_VOCABULARIES}
    values = {a: side[FACT_ATTRIBUTE_VOCABULARY[a]] for a in FACT_ATTRIBUTES}
    filler_values = (side["person"], side["city"], side["year"], side["colour"])
    pool = ALL_ENTITIES
    attributes = tuple(FACT_ATTRIBUTES)
    while True:  # the asked fact; with train values, from this split's share of all facts
        entity, attribute = rng.choice(pool), rng.choice(attributes)
        value = rng.choice(values[attribute])
        if (value_split == "heldout"
                or _asked_bucket(entity, attribute, value) in _SPLIT_BUCKETS[split]):
            break
    n_entities = rng.randint(math.ceil(n_facts / len(attributes)), min(n_facts, len(pool)))
    entities = [entity] + _distinct_draws(rng, lambda: rng.choice(pool), n_entities - 1, {entity})
    candidates = [(e, a) for e in entities for a in attributes if (e, a) != (entity, attribute)]
    pairs = [(entity, attribute)] + rng.sample(candidates, n_facts - 1)
    n_entity_distractors = sum(rng.random() < 0.5 for _ in range(n_distractors))
    taken = set(entities)
    room = (len(pool) - len(taken)) * len(attributes)
    if 2 * n_entity_distractors <= room:
        pairs += _distinct_draws(rng, lambda: (rng.choice(pool), rng.choice(attributes)),
                                 n_entity_distractors, {(e, a) for e in taken for a in attributes})
    else:
        others = [(e, a) for e in pool if e not in taken for a in attributes]
        pairs += rng.sample(others, min(n_entity_distractors, len(others)))
    sentences = [FACT_ATTRIBUTES[attribute].statement.format(entity=entity, value=value)]
    sentences += [FACT_ATTRIBUTES[a].statement.format(entity=e, value=rng.choice(values[a]))
                  for e, a in pairs[1:]]
    seen = set()
    for _ in range(n_distractors - (len(pairs) - n_facts)):
        sentence = filler_sentence(rng, *filler_values)
        for _retry in range(20):
            if sentence not in seen:
                break
            sentence = filler_sentence(rng, *filler_values)
        seen.add(sentence)
        sentences.append(sentence)
    rng.shuffle(sentences)
    question = FACT_ATTRIBUTES[attribute].question.format(entity=entity)
    return " ".join(sentences), question, value


def make_facts(n_examples: int, *, n_facts: int = 4, n_distractors: int = 0, seed: int = 0,
               split: str = "train", value_split: str | None = None) -> datasets.Dataset:
    """``n_examples`` procedural fact-lookup rows, deterministic for the arguments.

    Each context states ``n_facts`` facts about named entities (at most one value per entity and
    attribute), shuffled together with ``n_distractors`` distractors: facts about entities the
    question cannot be about, and filler sentences with similar words. The question asks for one
    stated fact; the answer is one word or a year. The asked (entity, attribute, value) triples of
    different splits never overlap. A smaller ``n_examples`` gives a prefix of a larger one.
    Row ids: ``facts-f{n_facts}-d{n_distractors}-{split}-{index}``.

    ``value_split`` (None, "train" or "heldout"; see the module docstring): with "train", every
    value in the contexts comes from the train share of ``FACT_VOCABULARIES``; "heldout" is for
    the test split only and uses the held-out share, so none of its answers (or other values)
    occurs in rows made with "train". Both never repeat a (context, question) pair, within a
    split or across splits, and raise ValueError when the settings cannot give ``n_examples``
    distinct rows. Row ids:
    ``facts-f{n_facts}-d{n_distractors}-{value_split}values-{split}-{index}``.
    """
    check_split(split)
    for name, value, low in (("n_examples", n_examples, 0), ("n_facts", n_facts, 1),
                             ("n_distractors", n_distractors, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if n_facts > len(ALL_ENTITIES) * len(FACT_ATTRIBUTES):
        raise ValueError(f"n_facts must be at most {len(ALL_ENTITIES) * len(FACT_ATTRIBUTES)}")
    if value_split is not None:
        return _make_value_split_facts(n_examples, n_facts, n_distractors, seed, split, value_split)
    rng = random.Random(f"ilcp-facts/{split}/{seed}")
    rows = []
    for index in range(n_examples):
        context, question, answer = _facts_example(rng, split, n_facts, n_distractors)
        rows.append({"id": f"facts-f{n_facts}-d{n_distractors}-{split}-{index}", "task": "facts",
                     "context": context, "question": question, "answer": answer})
    return to_dataset(rows)


# Consecutive repeated draws after which a value-split generator gives up on distinct rows.
_MAX_REPEATS = 2000


def _distinct_examples(n: int, draw, what: str):
    """Yield ``n`` results of ``draw()`` whose keys (``draw()`` returns (key, item)) differ."""
    seen, repeats = set(), 0
    while len(seen) < n:
        key, item = draw()
        if key in seen:
            repeats += 1
            if repeats > _MAX_REPEATS:
                raise ValueError(f"could not draw {n} distinct {what}: {len(seen)} found, then "
                                 f"{_MAX_REPEATS} repeats in a row; ask for fewer, or for more "
                                 "facts or distractors per context")
            continue
        repeats = 0
        seen.add(key)
        yield item


def _make_value_split_facts(n_examples: int, n_facts: int, n_distractors: int, seed: int,
                            split: str, value_split: str) -> datasets.Dataset:
    check_value_split(value_split)
    if value_split == "heldout" and split != "test":
        raise ValueError(f"value_split='heldout' is only for the test split, got split={split!r}: "
                         "train and validation rows use value_split='train'")
    rng = random.Random(f"ilcp-facts-values/{value_split}/{split}/{seed}")

    def draw():
        context, question, answer = _value_split_example(rng, split, n_facts, n_distractors,
                                                         value_split)
        return (context, question), (context, question, answer)

    prefix = f"facts-f{n_facts}-d{n_distractors}-{value_split}values-{split}"
    rows = [{"id": f"{prefix}-{index}", "task": "facts", "context": context,
             "question": question, "answer": answer}
            for index, (context, question, answer)
            in enumerate(_distinct_examples(n_examples, draw, f"{split} rows"))]
    return to_dataset(rows)


def _check_range(name: str, value, low: int) -> tuple[int, int]:
    if (not isinstance(value, (tuple, list)) or len(value) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
            or not low <= value[0] <= value[1]):
        raise ValueError(f"{name} must be a pair of ints (low, high) with {low} <= low <= high, "
                         f"got {value!r}")
    return int(value[0]), int(value[1])


def facts_contexts(n: int, seed: int = 0, n_facts_range: tuple[int, int] = (1, 8),
                   value_split: str = "train", *,
                   n_distractors_range: tuple[int, int] = (0, 0)) -> list[str]:
    """``n`` distinct unlabelled facts contexts, for a reconstruction pretraining stage.

    Each has a number of facts drawn uniformly from ``n_facts_range`` and of distractors from
    ``n_distractors_range`` (both inclusive), generated as `make_facts` does with the same
    ``value_split`` ("train": train values only, the contexts of the train split; "heldout":
    held-out values only, for measuring reconstruction of unseen values, never for training
    before a held-out evaluation). Deterministic for the arguments; a smaller ``n`` gives a
    prefix of a larger one.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    check_value_split(value_split)
    low, high = _check_range("n_facts_range", n_facts_range, 1)
    if high > len(ALL_ENTITIES) * len(FACT_ATTRIBUTES):
        raise ValueError("n_facts_range must stay within "
                         f"1..{len(ALL_ENTITIES) * len(FACT_ATTRIBUTES)}")
    d_low, d_high = _check_range("n_distractors_range", n_distractors_range, 0)
    split = "train" if value_split == "train" else "test"
    rng = random.Random(f"ilcp-facts-contexts/{value_split}/{seed}")

    def draw():
        n_facts, n_distractors = rng.randint(low, high), rng.randint(d_low, d_high)
        context = _value_split_example(rng, split, n_facts, n_distractors, value_split)[0]
        return context, context

    return list(_distinct_examples(n, draw, "contexts"))


def count_tokens(text: str, tokenizer=None) -> int:
    """Tokens in ``text`` by a Hugging Face tokenizer, or whitespace-separated words without one."""
    if tokenizer is None:
        return len(text.split())
    return len(tokenizer.encode(text, add_special_tokens=False))


def facts_for_length(target_tokens: int, tokenizer=None, *, n_facts: int = 4) -> dict:
    """``{"n_facts", "n_distractors"}`` whose contexts average about ``target_tokens`` tokens
    (counted by `count_tokens`); ``n_distractors`` is 0 when ``n_facts`` alone reaches the
    target. Pass the result to `make_facts` or `load_task("facts", ...)`."""
    positive_int("target_tokens", target_tokens)

    def mean_tokens(n_distractors: int) -> float:
        rows = make_facts(8, n_facts=n_facts, n_distractors=n_distractors, seed=12345)
        return sum(count_tokens(c, tokenizer) for c in rows["context"]) / len(rows)

    base = mean_tokens(0)
    if base >= target_tokens:
        return {"n_facts": n_facts, "n_distractors": 0}
    probe, length = 64, mean_tokens(64)
    for _ in range(3):  # secant steps; the token cost per distractor is close to constant
        slope = max((length - base) / probe, 1e-6)
        estimate = max(0, math.ceil((target_tokens - base) / slope))
        if estimate == probe:
            break
        probe, length = estimate, mean_tokens(estimate)
    return {"n_facts": n_facts, "n_distractors": probe}




# ------------------------------------------------------------------------------------- registry

FACTS_TEST_SIZE = 1000  # questions eval builds for the facts test split (bAbI en test files hold 1,000)


class FactsTask(Task):
    """``facts`` (a generator: ``n_examples`` and its settings are arguments) or, for eval only,
    ``facts-heldout`` (the test split whose values training never used)."""

    needs_facts_settings = True

    def __init__(self, name: str):
        self.name = name
        self.value_split = "heldout" if name == "facts-heldout" else None
        self.trainable = self.value_split is None

    def _kwargs(self, split: str, kwargs: dict) -> dict:
        kwargs = dict(kwargs)
        if "n_examples" not in kwargs:
            raise ValueError("the facts task needs n_examples")
        limit = kwargs.pop("limit", None)
        if limit is not None:
            kwargs["n_examples"] = min(kwargs["n_examples"], limit)
        if self.value_split is not None:
            kwargs["value_split"] = self.value_split
        return kwargs

    def load(self, split: str, **kwargs) -> datasets.Dataset:
        return make_facts(split=split, **self._kwargs(split, kwargs))

    def config_key(self, split: str, **kwargs) -> dict:
        bound = inspect.signature(make_facts).bind(split=split, **self._kwargs(split, kwargs))
        bound.apply_defaults()
        key = dict(bound.arguments, generator_version=FACTS_VERSION)
        if key["value_split"] is None:  # the original task keeps its original key
            del key["value_split"]
        else:
            check_value_split(key["value_split"])
            key["value_split_version"] = FACTS_VALUE_SPLIT_VERSION
        return {"task": "facts", **key}

    def training_kwargs(self, data, size: int, tokenizer=None, max_tokens: int | None = None, *,
                        text_limit: int | None = None) -> dict:
        kwargs = {"n_examples": size, "n_facts": data.facts_n_facts, "n_distractors": data.facts_n_distractors,
                  "seed": data.seed}
        if data.facts_value_split is not None:
            kwargs["value_split"] = data.facts_value_split
        return kwargs

    def eval_rows(self, limit: int | None, context: EvalTaskContext) -> EvalRows:
        """The split asked (``context.split``), built with the run's facts settings (``context.facts_settings``)."""
        n = FACTS_TEST_SIZE if limit is None else min(limit, FACTS_TEST_SIZE)
        settings = dict(context.facts_settings)
        if self.value_split is not None:
            settings["value_split"] = self.value_split
        split = context.split
        if split != "test" and settings.get("value_split") == "heldout":
            raise ValueError(f"task {self.name!r} asks held-out values, which only its test split holds: "
                             "evaluate it with split test")
        rows = make_facts(n, split=split, **settings).to_list()
        values = {None: "", "train": ", training values", "heldout": ", held-out values"}[settings.get("value_split")]
        desc = (f"facts {split} split ({settings['n_facts']} facts, {settings['n_distractors']} "
                f"distractors, seed {settings['seed']}{values})")
        return EvalRows(rows, FACTS_TEST_SIZE, desc)


@register_task("facts")
def _resolve_facts(name: str) -> Task:
    return FactsTask(name.lower())
