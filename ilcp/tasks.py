"""Handoff tasks as `datasets.Dataset` rows with the columns ``TASK_COLUMNS``:
``id``, ``task``, ``context``, ``question``, ``answer`` (all strings).

Two sources:

- bAbI (Weston et al. 2015, CC BY 3.0), read from files in the original format
  (``ID text`` lines; ``ID question<TAB>answer<TAB>supporting ids`` for questions; a story restarts
  when the ID goes back to 1). One row per question; its context is the story's statements before
  it. The validation split is carved from the train file by whole stories. Files are looked up
  under ``data_dir`` (default: the repository's ``data/babi``, or ``$ILCP_BABI_DIR``).
- ``facts``: procedural stories of short facts about named things ("Cedar is owned by Alice.")
  and one question about one of them ("Who owns Cedar?"). The context length is dialled with
  ``n_facts`` and ``n_distractors``; `facts_for_length` picks them for a target token count.

    from ilcp.tasks import load_task, task_config_key
    test = load_task("babi-qa1", "test", limit=100)
    train = load_task("babi:1", "train", variant="en-10k")
    facts = load_task("facts", "train", n_examples=500, n_facts=4, n_distractors=20)
    facts[0]["question"], facts[0]["answer"]      # e.g. ('Who owns Cedar?', 'Alice')
    key = task_config_key("babi-qa1", "test")            # JSON-serialisable; part of a cache key
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import os
import random
import re
import zlib
from pathlib import Path
from typing import NamedTuple

import datasets

TASK_COLUMNS = ("id", "task", "context", "question", "answer")
SPLITS = ("train", "validation", "test")
BABI_DIR_ENV = "ILCP_BABI_DIR"
DEFAULT_BABI_DIR = Path(__file__).resolve().parent.parent / "data" / "babi"
# Bump when make_facts would produce different rows for the same arguments.
FACTS_VERSION = 1

_FEATURES = datasets.Features({column: datasets.Value("string") for column in TASK_COLUMNS})


class TaskFormatError(ValueError):
    """A task file does not follow its format; the message names the file and the line."""


def _to_dataset(rows: list[dict]) -> datasets.Dataset:
    columns = {column: [row[column] for row in rows] for column in TASK_COLUMNS}
    return datasets.Dataset.from_dict(columns, features=_FEATURES)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; available: {', '.join(SPLITS)}")


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

    with open(path, encoding="utf-8") as handle:
        for line_no, raw in enumerate(handle, start=1):
            line = raw.rstrip("\r\n")
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


def babi_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The bAbI root: ``data_dir`` if given, else ``$ILCP_BABI_DIR``, else the repository's
    ``data/babi``. It holds one folder per variant (``en``, ``en-10k``)."""
    root = Path(data_dir or os.environ.get(BABI_DIR_ENV) or DEFAULT_BABI_DIR)
    if not root.is_dir():
        raise FileNotFoundError(
            f"bAbI data directory {root} not found: pass data_dir=, set {BABI_DIR_ENV}, "
            "or copy the bAbI v1.2 task folders (en/, en-10k/) there")
    return root


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
    _check_split(split)
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
        f"{', '.join(map(str, available)) or 'none'}); copy the bAbI task file there, or point "
        f"data_dir= or {BABI_DIR_ENV} at a folder that has it")


def _validation_stories(n_stories: int, fraction: float, seed: int) -> set[int]:
    count = round(n_stories * fraction)
    if fraction > 0 and n_stories > 1:
        count = min(max(count, 1), n_stories - 1)
    return set(random.Random(f"ilcp-babi-validation/{seed}").sample(range(n_stories), count))


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
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or a non-negative int, got {limit!r}")
    path = babi_file(task, split, variant=variant, data_dir=data_dir)
    stories = parse_babi_file(path)
    number = _babi_task_number(task)
    name = f"babi-qa{number}"
    prefix = name if variant == "en" else f"{name}-{variant.replace('-', '')}"
    chosen = range(len(stories))
    if split != "test":
        held_out = _validation_stories(len(stories), validation_fraction, seed)
        chosen = [i for i in chosen if (i in held_out) == (split == "validation")]
    rows = [
        {"id": f"{prefix}-{split}-s{s}-q{q}", "task": name,
         "context": context, "question": question, "answer": answer}
        for s in chosen for q, (context, question, answer) in enumerate(stories[s])
    ]
    return _to_dataset(rows if limit is None else rows[:limit])


# ---------------------------------------------------------------------------------------- facts

class FactAttribute(NamedTuple):
    statement: str  # "{entity} ... {value}."
    question: str   # "... {entity} ...?"
    values: tuple[str, ...]


_PEOPLE = tuple("Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Liam Maria Nina "
                "Oscar Paula Quentin Rachel Samuel Tara Victor Wendy Xavier Yusuf Zoe Hugo Ingrid "
                "Leon Mei Omar Priya Sofia Tomas Anika Boris Chloe Diego Elena Felix "
                "Hannah".split())
_CITIES = tuple("Lisbon Oslo Madrid Vienna Prague Dublin Warsaw Berlin Paris Rome Athens Helsinki "
                "Stockholm Copenhagen Budapest Zurich Geneva Munich Hamburg Milan Naples Porto "
                "Seville Valencia Krakow Tallinn Riga Vilnius Bergen Lyon Marseille Antwerp "
                "Rotterdam Bristol Leeds Glasgow Cardiff Toronto Boston Chicago Denver Seattle "
                "Austin Sydney Melbourne Osaka Kyoto Seoul Mumbai Nairobi Cairo Lima".split())
_COLOURS = tuple("red blue green yellow orange purple white black grey brown pink silver".split())
_YEARS = tuple(str(year) for year in range(1950, 2025))
_WEATHER = tuple("mild cold windy rainy sunny warm foggy dry".split())

FACT_ATTRIBUTES = {
    "owner": FactAttribute("{entity} is owned by {value}.", "Who owns {entity}?", _PEOPLE),
    "manager": FactAttribute("{entity} is managed by {value}.", "Who manages {entity}?", _PEOPLE),
    "city": FactAttribute("{entity} is based in {value}.", "In which city is {entity} based?",
                          _CITIES),
    "year": FactAttribute("{entity} was launched in {value}.",
                          "In which year was {entity} launched?", _YEARS),
    "colour": FactAttribute("{entity} is painted {value}.", "What colour is {entity}?", _COLOURS),
}

# Trees, minerals and birds; none is also a person's name, a city or a colour.
BASE_ENTITIES = tuple(
    "Cedar Birch Maple Oak Aspen Alder Spruce Larch Poplar Elm Cypress Juniper Linden Sequoia "
    "Hemlock Sycamore Beech Acacia Magnolia Quartz Basalt Granite Cobalt Garnet Topaz Onyx Agate "
    "Feldspar Mica Obsidian Pyrite Galena Gypsum Marble Flint Zircon Malachite Cinnabar Dolomite "
    "Falcon Heron Osprey Kestrel Finch Sparrow Condor Plover Egret Pelican Puffin Starling Swift "
    "Oriole Curlew Albatross Gannet Lark Ibis Kingfisher Petrel Tern Raven Harrier".split())
# One-word composites ("Cedarbrook") for contexts that need more entities than BASE_ENTITIES.
ALL_ENTITIES = BASE_ENTITIES + tuple(
    base + suffix for suffix in "brook field haven ridge wood stone vale moor crest ford".split()
    for base in BASE_ENTITIES)

_FILLERS = (
    "The weather in {city} was {weather} that week.",
    "{person} spent a weekend in {city}.",
    "{person} visited {city} in {year}.",
    "A trade fair took place in {city} in {year}.",
    "{person} and {other} met for coffee in {city}.",
    "{person} bought {colour} curtains.",
    "The morning train to {city} was late.",
    "{person} wrote a short report in {year}.",
    "Many visitors came to {city} in {year}.",
    "{person} prefers {colour} notebooks.",
)
# Which split an asked (entity, attribute, value) belongs to: by hash, so no split asks a fact
# that another split asks.
_SPLIT_BUCKETS = {"train": range(0, 8), "validation": range(8, 9), "test": range(9, 10)}


def _filler(rng: random.Random) -> str:
    person, other = rng.sample(_PEOPLE, 2)
    return rng.choice(_FILLERS).format(person=person, other=other, city=rng.choice(_CITIES),
                                       year=rng.choice(_YEARS), colour=rng.choice(_COLOURS),
                                       weather=rng.choice(_WEATHER))


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
        sentence = _filler(rng)
        for _retry in range(20):
            if sentence not in seen:
                break
            sentence = _filler(rng)
        seen.add(sentence)
        sentences.append(sentence)
    rng.shuffle(sentences)
    question = FACT_ATTRIBUTES[attribute].question.format(entity=entity)
    return " ".join(sentences), question, value


def make_facts(n_examples: int, *, n_facts: int = 4, n_distractors: int = 0, seed: int = 0,
               split: str = "train") -> datasets.Dataset:
    """``n_examples`` procedural fact-lookup rows, deterministic for the arguments.

    Each context states ``n_facts`` facts about named entities (at most one value per entity and
    attribute), shuffled together with ``n_distractors`` distractors: facts about entities the
    question cannot be about, and filler sentences with similar words. The question asks for one
    stated fact; the answer is one word or a year. The asked (entity, attribute, value) triples of
    different splits never overlap. A smaller ``n_examples`` gives a prefix of a larger one.
    Row ids: ``facts-f{n_facts}-d{n_distractors}-{split}-{index}``.
    """
    _check_split(split)
    for name, value, low in (("n_examples", n_examples, 0), ("n_facts", n_facts, 1),
                             ("n_distractors", n_distractors, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if n_facts > len(ALL_ENTITIES) * len(FACT_ATTRIBUTES):
        raise ValueError(f"n_facts must be at most {len(ALL_ENTITIES) * len(FACT_ATTRIBUTES)}")
    rng = random.Random(f"ilcp-facts/{split}/{seed}")
    rows = []
    for index in range(n_examples):
        context, question, answer = _facts_example(rng, split, n_facts, n_distractors)
        rows.append({"id": f"facts-f{n_facts}-d{n_distractors}-{split}-{index}", "task": "facts",
                     "context": context, "question": question, "answer": answer})
    return _to_dataset(rows)


def count_tokens(text: str, tokenizer=None) -> int:
    """Tokens in ``text`` by a Hugging Face tokenizer, or whitespace-separated words without one."""
    if tokenizer is None:
        return len(text.split())
    return len(tokenizer.encode(text, add_special_tokens=False))


def facts_for_length(target_tokens: int, tokenizer=None, *, n_facts: int = 4) -> dict:
    """``{"n_facts", "n_distractors"}`` whose contexts average about ``target_tokens`` tokens
    (counted by `count_tokens`); ``n_distractors`` is 0 when ``n_facts`` alone reaches the
    target. Pass the result to `make_facts` or `load_task("facts", ...)`."""
    if isinstance(target_tokens, bool) or not isinstance(target_tokens, int) or target_tokens < 1:
        raise ValueError(f"target_tokens must be a positive int, got {target_tokens!r}")

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

def _builder(name: str):
    if name == "facts":
        return "facts", make_facts
    match = re.fullmatch(r"babi[-:_](?:qa)?(\d+)", name.strip(), re.IGNORECASE)
    if match:
        return f"babi-qa{int(match.group(1))}", load_babi
    raise ValueError(f"unknown task {name!r}; available: 'facts', 'babi-qaN' or 'babi:N' (N a bAbI "
                     "task number with a file under the bAbI data directory)")


def load_task(name: str, split: str, **kwargs) -> datasets.Dataset:
    """Rows for a named task: "facts" (kwargs of `make_facts`; ``n_examples`` required, ``limit``
    caps it) or "babi-qa1" / "babi:1" (kwargs of `load_babi`)."""
    canonical, builder = _builder(name)
    if builder is load_babi:
        return load_babi(canonical, split, **kwargs)
    if "n_examples" not in kwargs:
        raise ValueError("the facts task needs n_examples")
    limit = kwargs.pop("limit", None)
    if limit is not None:
        kwargs["n_examples"] = min(kwargs["n_examples"], limit)
    return make_facts(split=split, **kwargs)


@functools.lru_cache(maxsize=64)
def _sha256_cached(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def task_config_key(name: str, split: str, **kwargs) -> dict:
    """A JSON-serialisable description of what `load_task` builds for these arguments, with
    defaults filled in; for bAbI it names the source file and a hash of its content (not its
    location), so a changed file changes the key."""
    canonical, builder = _builder(name)
    _check_split(split)
    if builder is load_babi:
        bound = inspect.signature(load_babi).bind(canonical, split, **kwargs)
        bound.apply_defaults()
        key = dict(bound.arguments)
        path = babi_file(canonical, split, variant=key["variant"], data_dir=key.pop("data_dir"))
        stat = path.stat()
        key.update(source=path.name, source_sha256=_sha256_cached(str(path), stat.st_mtime_ns,
                                                                   stat.st_size))
        if split == "test":  # the validation carve does not touch the test file
            del key["validation_fraction"], key["seed"]
    else:
        kwargs = dict(kwargs)
        if "n_examples" not in kwargs:
            raise ValueError("the facts task needs n_examples")
        limit = kwargs.pop("limit", None)
        if limit is not None:
            kwargs["n_examples"] = min(kwargs["n_examples"], limit)
        bound = inspect.signature(make_facts).bind(split=split, **kwargs)
        bound.apply_defaults()
        key = dict(bound.arguments, generator_version=FACTS_VERSION)
    return {"task": canonical, **{k: v for k, v in key.items() if k != "task"}}
