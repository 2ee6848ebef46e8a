"""Handoff tasks as `datasets.Dataset` rows with the columns ``TASK_COLUMNS``:
``id``, ``task``, ``context``, ``question``, ``answer`` (all strings).

Two sources, and one built from bAbI:

- bAbI (Weston et al. 2015, CC BY 3.0), read from files in the original format
  (``ID text`` lines; ``ID question<TAB>answer<TAB>supporting ids`` for questions; a story restarts
  when the ID goes back to 1). One row per question; its context is the story's statements before
  it. The validation split is carved from the train file by whole stories. Files are looked up
  under ``data_dir`` (default: the package's ``ilcp/data/babi``, or ``$ILCP_BABI_DIR``).
  Several tasks mix with ``"babi:1+2+3"`` (or a list such as ``["babi:1", "babi:2"]``): the
  rows of each task as `load_babi` gives them, interleaved in proportion to the tasks' sizes
  (`load_babi_mix`); each row's ``task`` names its own task. `babi_stories` gives the distinct
  story texts of one or several tasks, without questions, for reconstruction pretraining.
- ``facts``: procedural stories of short facts about named things ("Cedar is owned by Alice.")
  and one question about one of them ("Who owns Cedar?"). The context length is dialled with
  ``n_facts`` and ``n_distractors``; `facts_for_length` picks them for a target token count.

  Held-out values: ``value_split="train"`` or ``"heldout"`` (a keyword of `make_facts`, so also
  of `load_task("facts", ...)`) switches to the larger vocabularies ``FACT_VOCABULARIES`` (people,
  cities, years, colours), each partitioned once and for all by a fixed hash into train values
  and held-out values (``HELDOUT_FRACTION`` of each vocabulary). With ``value_split="train"``
  (for the train, validation and test splits) every value in a context (the asked answer, the
  other facts, the filler sentences) is a train value; ``value_split="heldout"`` exists only for
  the test split, and every value in its contexts is a held-out value, so its answers never occur
  anywhere in training data made with ``value_split="train"``. Both modes never repeat a
  (context, question) pair within or across splits, and draw entities from ``ALL_ENTITIES``.
  The default ``value_split=None`` is the original generator, row for row (it may repeat rows
  when its small space is exhausted, e.g. ``n_facts=1`` and many rows). `facts_contexts` gives
  unlabelled contexts of either value split for reconstruction pretraining.
- ``babilong:<task>:<length>`` (`ilcp.babilong`): the rows of bAbI task ``<task>``, each story's
  sentences spread, in order, through public-domain prose until the context is ``<length>``
  tokens of the LM's tokenizer (``0``, ``0.5k``, ``1k``, ``2k``, ``4k`` or a number of tokens).

    from ilcp.tasks import load_task, task_config_key
    test = load_task("babi-qa1", "test", limit=100)
    train = load_task("babi:1", "train", variant="en-10k")
    mixed = load_task("babi:1+2+3", "train")                  # rows of qa1, qa2, qa3 interleaved
    facts = load_task("facts", "train", n_examples=500, n_facts=4, n_distractors=20)
    facts[0]["question"], facts[0]["answer"]      # e.g. ('Who owns Cedar?', 'Alice')
    train = load_task("facts", "train", n_examples=50_000, value_split="train")
    unseen = load_task("facts", "test", n_examples=1000, value_split="heldout")
    key = task_config_key("babi-qa1", "test")            # JSON-serialisable; part of a cache key
    long = load_task("babilong:1:2k", "test", tokenizer=lm.tokenizer)  # see ilcp.babilong
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
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

import datasets

from .babilong import (
    GENERATOR_VERSION,
    BabilongTask,
    background_key,
    babilong_context,
    is_babilong_name,
    parse_babilong_name,
    story_sentences,
    tokenizer_key,
)
from .checks import positive_int

TASK_COLUMNS = ("id", "task", "context", "question", "answer")
SPLITS = ("train", "validation", "test")
BABI_DIR_ENV = "ILCP_BABI_DIR"
DEFAULT_BABI_DIR = Path(__file__).resolve().parent / "data" / "babi"
# Bump when make_facts would produce different rows for the same arguments.
FACTS_VERSION = 1
# Bump when make_facts with a value_split, or the value vocabularies and their partition, change.
FACTS_VALUE_SPLIT_VERSION = 1

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
    """The bAbI root: ``data_dir`` if given, else ``$ILCP_BABI_DIR``, else the package's
    ``ilcp/data/babi`` (package data). It holds one folder per variant (``en``, ``en-10k``)."""
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


def _check_validation_fraction(validation_fraction: float) -> None:
    if not 0 <= validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")


def _check_limit(limit) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be None or a non-negative int, got {limit!r}")


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
    _check_limit(limit)
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
    return _to_dataset(rows if limit is None else rows[:limit])


def babi_task_numbers(tasks: int | str | Sequence[int | str]) -> tuple[int, ...]:
    """Sorted task numbers of a mix: "1+2+3", "babi:1+2", "qa1+qa3", [1, "babi:2"] or one task."""
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


def _interleave(groups: Sequence[Sequence]) -> list:
    """The items of all groups, each group spread evenly over the result (item i of a group of n
    sits at (i + 1/2) / n; ties go to the earlier group), so any prefix mixes them in proportion."""
    keyed = [(Fraction(2 * i + 1, 2 * len(group)), g, i)
             for g, group in enumerate(groups) for i in range(len(group))]
    return [groups[g][i] for _, g, i in sorted(keyed)]


def load_babi_mix(tasks: str | Sequence[int | str], split: str, *, variant: str = "en",
                  data_dir: str | os.PathLike | None = None, limit: int | None = None,
                  validation_fraction: float = 0.1, seed: int = 0) -> datasets.Dataset:
    """Rows of several bAbI tasks ("1+2+3", "babi:1+2", or a list such as [1, "qa2"]).

    Each task contributes exactly the rows `load_babi` gives it for the same arguments (so the
    validation split is carved from each train file by whole stories, and ids and the ``task``
    column name the row's own task); the tasks are sorted by number and their rows interleaved
    deterministically in proportion to their sizes, so ``limit`` (the first N rows) keeps the
    mix. A single task gives the same rows as `load_babi`.
    """
    _check_validation_fraction(validation_fraction)
    _check_limit(limit)
    groups = [load_babi(number, split, variant=variant, data_dir=data_dir,
                        validation_fraction=validation_fraction, seed=seed).to_list()
              for number in babi_task_numbers(tasks)]
    rows = _interleave(groups)
    return _to_dataset(rows if limit is None else rows[:limit])


def babi_stories(tasks: int | str | Sequence[int | str], variant: str = "en",
                 split: str = "train", *, data_dir: str | os.PathLike | None = None,
                 validation_fraction: float = 0.1, seed: int = 0,
                 prefixes: bool = False) -> list[str]:
    """The distinct story texts of one or several bAbI tasks, without questions or answers.

    A story's text is all its statements up to its last question (the context of that
    question). ``split`` picks the stories as `load_babi` does, so "train" leaves out the stories
    of the validation split of the same ``validation_fraction`` and ``seed``. With
    ``prefixes=True`` every question's context (each prefix of a story that a row uses) is
    included too. Tasks are interleaved as in `load_babi_mix`; duplicates are dropped, keeping
    the first occurrence.
    """
    _check_split(split)
    _check_validation_fraction(validation_fraction)
    groups = []
    for number in babi_task_numbers(tasks):
        stories = parse_babi_file(babi_file(number, split, variant=variant, data_dir=data_dir))
        texts = []
        for index in _split_stories(len(stories), split, validation_fraction, seed):
            story = stories[index]
            contexts = [context for context, _, _ in story] if prefixes else [story[-1][0]]
            texts += [context for context in contexts if context]
        groups.append(texts)
    return list(dict.fromkeys(_interleave(groups)))


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
# Value vocabularies of the value-split modes: each starts with the original values and adds
# more real names and words of the same kind, all single words, none shared between two
# vocabularies or with an entity, a weather word or a word of the sentence templates.
FACT_VOCABULARIES = {
    "person": _PEOPLE + tuple(
        "Aaron Abigail Adam Adrian Ahmed Aisha Alan Albert Alberto Alexei Alfred Amara Amir Ana "
        "Andre Andrea Angela Anna Anton Arjun Arthur Astrid Beatrice Benjamin Bernard Bianca "
        "Bruno Caleb Camila Carlos Caroline Cecilia Charles Clara Colin Conor Cristina Daniel "
        "Daria Derek Dmitri Dora Edgar Edith Eduardo Elias Elif Eliza Emil Emily Enzo Eric Erik "
        "Esther Ethan Eva Fatima Fernando Fiona Florian Francesca Gabriel Gemma Georg George "
        "Gerald Gustav Hamid Harold Harriet Hassan Helen Hector Helga Hiroshi Ian Ibrahim Igor "
        "Ines Isaac Isabel Ivan Jacob James Jamal Jane Javier Jonas Jorge Joseph Julia Julian Kai "
        "Kamala Karl Kasper Katja Kenji Kevin Khalid Klaus Lars Laura Leila Lena Leonard Lucas "
        "Lucia Luis Luka Magnus Malik Marco Marek Margaret Marius Martha Mateo Matilda Max Miguel "
        "Mila Miriam Mohammed Monica Nadia Naomi Nathan Nikolai Noah Nora Olga Oliver Olivia "
        "Pablo Patrick Pedro Peter Philip Pieter Rafael Rahul Ravi Rebecca Ricardo Rita Robert "
        "Roberto Rosa Rui Ruth Sakura Salma Sara Sebastian Simon Stefan Susan Sven Tanya "
        "Theo Thomas Timothy Ulrich Ursula Valeria Vera Viktor Walter Wei William Yara Yuki Yves "
        "Zara Zainab Agnes Alma Anders Beatriz Dalia Elsa Emre Farid Gita Hana Ilse Jana Joel "
        "Kofi Lotte Maya Nils Oskar Petra Rania Soren Tobias Uma Vanya Wanda Yasmin Zeynep Amelia "
        "Benedict Cyrus Desmond Dorothy Edmund Elijah Eleanor Gideon Greta Hilda Imogen Ivo "
        "Jasper Joaquin Kiran Leopold Lionel Lorenzo Lydia Mabel Mario Matteo Mira Nadine Nikhil "
        "Odette Orla Otto Quinn Raquel Reza Rohan Rupert Silas Tamsin Tessa Ugo Vivian Wilhelm "
        "Yosef Zoltan".split()),
    "city": _CITIES + tuple(
        "Amsterdam Barcelona Bilbao Bologna Bordeaux Bratislava Brussels Bucharest Cologne "
        "Dresden Edinburgh Florence Frankfurt Gdansk Genoa Ghent Gothenburg Graz Hanover "
        "Innsbruck Istanbul Kyiv Leipzig Liverpool Ljubljana Lucerne Luxembourg Malmo Manchester "
        "Minsk Montpellier Nantes Nuremberg Palermo Pisa Reykjavik Salzburg Sarajevo Stuttgart "
        "Strasbourg Tampere Thessaloniki Toulouse Trieste Turin Utrecht Venice Verona Wroclaw "
        "Zagreb Belgrade Skopje Tirana Valletta Nicosia Ankara Izmir Tbilisi Yerevan Baku Tehran "
        "Baghdad Beirut Amman Damascus Jerusalem Riyadh Dubai Doha Muscat Karachi Lahore Delhi "
        "Kolkata Chennai Bangalore Hyderabad Colombo Kathmandu Dhaka Yangon Bangkok Hanoi Manila "
        "Jakarta Singapore Taipei Shanghai Beijing Shenzhen Tokyo Nagoya Sapporo Busan Perth "
        "Brisbane Adelaide Auckland Wellington Vancouver Montreal Ottawa Calgary Winnipeg Halifax "
        "Quebec Detroit Atlanta Miami Dallas Houston Phoenix Portland Philadelphia Baltimore "
        "Pittsburgh Cleveland Memphis Nashville Minneapolis Milwaukee Sacramento Oakland Honolulu "
        "Anchorage Havana Bogota Quito Caracas Santiago Montevideo Asuncion Recife Brasilia "
        "Curitiba Medellin Cusco Guadalajara Monterrey Tijuana Lagos Accra Dakar Casablanca "
        "Marrakesh Tunis Algiers Kampala Kigali Lusaka Harare Durban Johannesburg Khartoum "
        "Mombasa Luanda Maputo Windhoek Kinshasa".split()),
    "year": _YEARS + tuple(str(year) for year in range(1800, 1950)),
    "colour": _COLOURS + tuple(
        "crimson scarlet maroon navy teal turquoise cyan magenta violet indigo lavender lilac "
        "beige ivory cream tan khaki olive amber gold bronze copper ochre mauve burgundy coral "
        "salmon peach mint lime charcoal plum azure vermilion sienna taupe saffron mustard "
        "emerald jade ruby sapphire slate aqua fuchsia periwinkle rust".split()),
}
# The vocabulary each attribute's values come from.
FACT_ATTRIBUTE_VOCABULARY = {"owner": "person", "manager": "person", "city": "city",
                             "year": "year", "colour": "colour"}
VALUE_SPLITS = ("train", "heldout")
# Share of each vocabulary held out: the values with the smallest CRC-32 of
# "ilcp-heldout-value/<value>" (ties by the value), rounded to a whole count.
HELDOUT_FRACTION = 0.25


def _partition_values(values: Sequence[str]) -> dict[str, tuple[str, ...]]:
    ranked = sorted(values, key=lambda v: (zlib.crc32(f"ilcp-heldout-value/{v}".encode()), v))
    held = set(ranked[:round(len(values) * HELDOUT_FRACTION)])
    return {"train": tuple(v for v in values if v not in held),
            "heldout": tuple(v for v in values if v in held)}


_VALUE_PARTITION = {name: _partition_values(values) for name, values in FACT_VOCABULARIES.items()}


def fact_values(vocabulary: str, value_split: str | None = None) -> tuple[str, ...]:
    """The values of a vocabulary ("person", "city", "year", "colour") or of an attribute of
    ``FACT_ATTRIBUTES`` ("owner", ...) in the value-split modes: all of them (``None``), or the
    train or held-out share (``"train"``, ``"heldout"``), in vocabulary order."""
    name = FACT_ATTRIBUTE_VOCABULARY.get(vocabulary, vocabulary)
    if name not in FACT_VOCABULARIES:
        raise ValueError(f"unknown vocabulary {vocabulary!r}; available: "
                         f"{', '.join([*FACT_VOCABULARIES, *FACT_ATTRIBUTE_VOCABULARY])}")
    if value_split is None:
        return FACT_VOCABULARIES[name]
    _check_value_split(value_split)
    return _VALUE_PARTITION[name][value_split]


def _check_value_split(value_split) -> None:
    if value_split not in VALUE_SPLITS:
        raise ValueError(f"unknown value_split {value_split!r}; available: "
                         f"{', '.join(VALUE_SPLITS)} (or None for the original facts task)")

# Which split an asked (entity, attribute, value) belongs to: by hash, so no split asks a fact
# that another split asks.
_SPLIT_BUCKETS = {"train": range(0, 8), "validation": range(8, 9), "test": range(9, 10)}


def _filler(rng: random.Random, people: Sequence[str] = _PEOPLE,
            cities: Sequence[str] = _CITIES, years: Sequence[str] = _YEARS,
            colours: Sequence[str] = _COLOURS) -> str:
    person, other = rng.sample(people, 2)
    return rng.choice(_FILLERS).format(person=person, other=other, city=rng.choice(cities),
                                       year=rng.choice(years), colour=rng.choice(colours),
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
    side = {name: _VALUE_PARTITION[name][value_split] for name in FACT_VOCABULARIES}
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
        sentence = _filler(rng, *filler_values)
        for _retry in range(20):
            if sentence not in seen:
                break
            sentence = _filler(rng, *filler_values)
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
    _check_split(split)
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
    return _to_dataset(rows)


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
    _check_value_split(value_split)
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
    return _to_dataset(rows)


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
    _check_value_split(value_split)
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


# ------------------------------------------------------------------------------------- BABILong

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
        return _to_dataset(_babilong_mix(
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
    return _to_dataset(rows)


def babilong_stories(name: str, split: str, *, variant: str = "en",
                     data_dir: str | os.PathLike | None = None, limit: int | None = None,
                     validation_fraction: float = 0.1, seed: int = 0, **_ignored) -> list[list[str]]:
    """The bAbI story (its sentences, in order) behind each row `load_babilong` gives for the same
    arguments, row for row; other keyword arguments of `load_babilong` are accepted and ignored.
    With `ilcp.babilong.story_token_mask` it says which context tokens are the story's: a
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
    _check_limit(limit)
    sizes = []
    for number in task.numbers:
        _babi(task._replace(number=number), name, split, babi_kwargs["variant"], babi_kwargs["data_dir"])
        sizes.append(len(load_babi(number, split, **babi_kwargs)))
    order = _interleave([[(g, i) for i in range(size)] for g, size in enumerate(sizes)])
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
    _check_split(split)
    if task.length > 0 and tokenizer is None:
        raise ValueError(f"BABILong task {name!r} counts its length in the LM's tokens: pass "
                         "tokenizer= (the LM's tokenizer)")
    if len(task.numbers) > 1:  # each task's own key (every row of it), then the mix's limit
        return {"task": task.name, "limit": limit,
                "parts": [babilong_config_key(part, split, tokenizer=tokenizer, variant=variant, data_dir=data_dir,
                                              validation_fraction=validation_fraction, seed=seed,
                                              background_dir=background_dir) for part in task.parts]}
    source, sha256 = _source_key(_babi(task, name, split, variant, data_dir))
    key = {"task": task.name, "split": split, "length_tokens": task.length, "variant": variant,
           "limit": limit, "validation_fraction": validation_fraction, "seed": seed,
           "source": source, "source_sha256": sha256, **background_key(background_dir),
           "tokenizer": tokenizer_key(tokenizer) if task.length > 0 else None,
           "generator_version": GENERATOR_VERSION}
    if split == "test":  # the validation carve does not touch the test file
        del key["validation_fraction"]
    return key


# ------------------------------------------------------------------------------------- registry

_BABI_NAME = re.compile(r"babi[-:_](?:qa)?\d+(?:\+(?:babi[-:_]?)?(?:qa)?\d+)*\Z", re.IGNORECASE)


def _builder(name):
    """(canonical name, builder, bAbI task numbers or None) of a task name."""
    if isinstance(name, (list, tuple)):
        numbers = babi_task_numbers(name)
    elif isinstance(name, str) and name == "facts":
        return "facts", make_facts, None
    elif is_babilong_name(name):
        task = parse_babilong_name(name)
        return task.name, load_babilong, task.numbers
    elif isinstance(name, str) and _BABI_NAME.match(name.strip()):
        numbers = babi_task_numbers(name.strip())
    else:
        raise ValueError(f"unknown task {name!r}; available: 'facts', 'babi-qaN' or 'babi:N' (N a "
                         "bAbI task number with a file under the bAbI data directory), a mix "
                         "such as 'babi:1+2+3', or 'babilong:N:LENGTH' such as 'babilong:1:2k'")
    if len(numbers) == 1:
        return f"babi-qa{numbers[0]}", load_babi, numbers
    return "babi-qa" + "+qa".join(map(str, numbers)), load_babi_mix, numbers


def load_task(name: str | Sequence[str], split: str, **kwargs) -> datasets.Dataset:
    """Rows for a named task: "facts" (kwargs of `make_facts`, ``value_split`` included;
    ``n_examples`` required, ``limit`` caps it), "babi-qa1" / "babi:1" (kwargs of `load_babi`),
    or a mix of bAbI tasks, "babi:1+2+3" or a list of task names (kwargs of `load_babi_mix`), or
    "babilong:1:2k" (kwargs of `load_babilong`, ``tokenizer=`` the LM's)."""
    canonical, builder, numbers = _builder(name)
    if builder is load_babilong:
        return load_babilong(name, split, **kwargs)
    if builder is load_babi:
        return load_babi(canonical, split, **kwargs)
    if builder is load_babi_mix:
        return load_babi_mix(numbers, split, **kwargs)
    if "n_examples" not in kwargs:
        raise ValueError("the facts task needs n_examples")
    limit = kwargs.pop("limit", None)
    if limit is not None:
        kwargs["n_examples"] = min(kwargs["n_examples"], limit)
    return make_facts(split=split, **kwargs)


@functools.lru_cache(maxsize=64)
def _sha256_cached(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _source_key(path: Path) -> tuple[str, str]:
    stat = path.stat()
    return path.name, _sha256_cached(str(path), stat.st_mtime_ns, stat.st_size)


def task_config_key(name: str | Sequence[str], split: str, **kwargs) -> dict:
    """A JSON-serialisable description of what `load_task` builds for these arguments, with
    defaults filled in; for bAbI it names the source file and a hash of its content (not its
    location), so a changed file changes the key. A bAbI mix lists its files and hashes, in
    task order; a facts ``value_split`` adds itself and ``value_split_version``. A BABILong task
    adds its length, the background's hash, the tokenizer's and the generator version
    (`babilong_config_key`)."""
    canonical, builder, numbers = _builder(name)
    _check_split(split)
    if builder is load_babilong:
        return babilong_config_key(name, split, **kwargs)
    if builder is load_babi:
        bound = inspect.signature(load_babi).bind(canonical, split, **kwargs)
        bound.apply_defaults()
        key = dict(bound.arguments)
        path = babi_file(canonical, split, variant=key["variant"], data_dir=key.pop("data_dir"))
        source, sha256 = _source_key(path)
        key.update(source=source, source_sha256=sha256)
        if split == "test":  # the validation carve does not touch the test file
            del key["validation_fraction"], key["seed"]
    elif builder is load_babi_mix:
        bound = inspect.signature(load_babi_mix).bind(numbers, split, **kwargs)
        bound.apply_defaults()
        key = dict(bound.arguments)
        del key["tasks"]
        data_dir = key.pop("data_dir")
        sources = [_source_key(babi_file(number, split, variant=key["variant"], data_dir=data_dir))
                   for number in numbers]
        key.update(source=[source for source, _ in sources],
                   source_sha256=[sha256 for _, sha256 in sources])
        if split == "test":
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
        if key["value_split"] is None:  # the original task keeps its original key
            del key["value_split"]
        else:
            _check_value_split(key["value_split"])
            key["value_split_version"] = FACTS_VALUE_SPLIT_VERSION
    return {"task": canonical, **{k: v for k, v in key.items() if k != "task"}}
