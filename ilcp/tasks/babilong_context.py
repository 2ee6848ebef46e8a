"""BABILong-style long contexts (Kuratov et al. 2024): a bAbI story hidden in natural prose.

A task ``babilong:<task>:<length>`` (``babilong:1:2k``) takes the rows of bAbI task ``<task>``
(`ilcp.tasks.load_babi`, any task whose file the bAbI data directory holds) and replaces each
row's context by `babilong_context`: the story's sentences, in their order, inserted at random
sentence boundaries of a contiguous run of background prose, so the context reaches ``<length>``
tokens of the LM's own tokenizer. The question and answer are the bAbI ones, unchanged.

    from ilcp.tasks import load_task, task_config_key
    rows = load_task("babilong:1:2k", "test", tokenizer=lm.tokenizer, limit=100)
    key = task_config_key("babilong:1:2k", "test", tokenizer=lm.tokenizer)

Lengths: ``0`` (the plain story), ``0.5k``, ``1k``, ``2k``, ``4k`` (any ``<x>k`` with
k = 1024 tokens, as long as it is a whole number of tokens), or a plain number of tokens
(``1500``).

Length rule, for a target of T tokens: the context never exceeds T tokens (counted with
``add_special_tokens=False``). Background sentences are added in text order from a random start;
one that would overshoot is skipped, and the walk stops once the gap is under ``MIN_GAP`` tokens
or ``LOOKAHEAD`` sentences in a row did not fit; the token counts are then checked on the whole
text (merges at the joins) and the longest text within T is kept. The gap that remains is below
the shortest sentence tried at the end: at most 19 tokens with the tiny test tokenizer and 7
with SmolLM2's on bAbI tasks 1 and 3 at 0.5k to 4k, so within 5% of T for T >= 512. A story that
alone is longer than T is returned plain (no background), longer than T.

Background: the books under ``data/background/`` (`ilcp.datadir`) (public domain; see the README there),
split into sentences; sentences that read like bAbI facts (`is_babi_like`) and very short or
long ones are dropped. Each book's kept sentences are cut into three contiguous passages, the
first 80% for the train split, the next 10% for validation and the last 10% for test, so the
splits never share background text. Everything is deterministic for (story, length, tokenizer,
split, seed).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import re
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from ..datadir import data_root

# Bump when babilong_context, the sentence splitter or the filters would give other text.
GENERATOR_VERSION = 1
TOKENS_PER_K = 1024
NAMED_LENGTHS = ("0", "0.5k", "1k", "2k", "4k")
# Each book's kept sentences, in order, are cut at these fractions into train / validation / test.
SPLIT_FRACTIONS = {"train": (0.0, 0.8), "validation": (0.8, 0.9), "test": (0.9, 1.0)}
MIN_WORDS, MAX_WORDS = 5, 48  # background sentences kept
MIN_GAP = 4     # tokens of slack at which the background walk stops
LOOKAHEAD = 64  # sentences in a row that may not fit before the walk stops

_SPLITS = tuple(SPLIT_FRACTIONS)
_NAME = re.compile(r"babilong[:_-]((?:qa)?\d+(?:\+(?:qa)?\d+)*)(?:[:_-](.*))?\Z", re.IGNORECASE | re.DOTALL)
_LENGTH = re.compile(r"(\d+(?:\.\d+)?)(k?)\Z", re.IGNORECASE)


class BabilongTask(NamedTuple):
    """A parsed task name: bAbI task ``number``, ``length`` in tokens, canonical ``name``
    (``"babilong-qa1-2k"``, also the rows' ``task`` column). A mix (``"babilong:1+8:0.5k"``,
    canonical ``"babilong-qa1+qa8-0.5k"``) lists its tasks in ``numbers``, sorted, ``number``
    being the first; a single task's ``numbers`` is ``(number,)``."""

    number: int
    length: int
    name: str
    numbers: tuple[int, ...] = ()

    @property
    def parts(self) -> list[str]:
        """The single-task names of a mix (``["babilong:1:0.5k", "babilong:8:0.5k"]``), or this task's."""
        return [f"babilong:{n}:{length_label(self.length)}" for n in (self.numbers or (self.number,))]


class BackgroundSentence(NamedTuple):
    """One background sentence: its ``source`` file, its ``index`` among that file's kept
    sentences (its position in the book), and its ``text``."""

    source: str
    index: int
    text: str


# ---------------------------------------------------------------------------------------- names

def is_babilong_name(name) -> bool:
    """Whether ``name`` is meant as a BABILong task ("babilong:..."), well-formed or not."""
    return isinstance(name, str) and name.strip().lower().startswith("babilong")


def parse_length(text: str | int) -> int:
    """Tokens of a length: ``"0"``, ``"0.5k"``, ``"1k"``, ``"2k"``, ``"4k"`` (k = 1024), any
    ``"<x>k"`` that is a whole number of tokens, a plain number (``"1500"``) or an int >= 0."""
    if isinstance(text, int) and not isinstance(text, bool):
        tokens = text
    else:
        match = _LENGTH.match(str(text).strip())
        if match is None:
            raise ValueError(f"unknown length {text!r}: use {', '.join(NAMED_LENGTHS)} "
                             "(k = 1024 tokens) or a number of tokens such as 1500")
        value = float(match.group(1)) * (TOKENS_PER_K if match.group(2) else 1)
        if value != int(value):
            raise ValueError(f"length {text!r} is not a whole number of tokens (k = 1024)")
        tokens = int(value)
    if tokens < 0:
        raise ValueError(f"a length must be >= 0 tokens, got {text!r}")
    return tokens


def length_label(tokens: int) -> str:
    """``"0"``, ``"0.5k"``, ``"1k"``, ``"1.5k"``... for multiples of 512 tokens, else the number."""
    if tokens > 0 and tokens % (TOKENS_PER_K // 2) == 0:
        return f"{tokens / TOKENS_PER_K:g}k"
    return str(tokens)


def parse_babilong_name(name: str) -> BabilongTask:
    """``"babilong:<task>:<length>"`` (also ``babilong:qa1:2k``, or a mix ``babilong:1+8:0.5k``)
    as a `BabilongTask`; ValueError naming what is wrong. Does not look for the bAbI file
    (`load_babilong` does)."""
    if not isinstance(name, str):
        raise ValueError(f"a BABILong task name is a string, got {name!r}")
    match = _NAME.match(name.strip())
    if match is None:
        raise ValueError(f"unknown BABILong task {name!r}: use 'babilong:<task>:<length>', e.g. "
                         f"'babilong:1:2k' (lengths: {', '.join(NAMED_LENGTHS)} or a number of tokens)")
    numbers = [int(part.lower().removeprefix("qa")) for part in match.group(1).split("+")]
    length, tasks = match.group(2), match.group(1)
    if min(numbers) < 1:
        raise ValueError(f"BABILong task {name!r}: the bAbI task number must be >= 1")
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"BABILong task {name!r}: a bAbI task is listed twice")
    if not length:
        raise ValueError(f"BABILong task {name!r} needs a length: 'babilong:{tasks}:<length>', e.g. "
                         f"'babilong:{tasks}:2k' (lengths: {', '.join(NAMED_LENGTHS)} or a number of "
                         "tokens)")
    try:
        tokens = parse_length(length)
    except ValueError as e:
        raise ValueError(f"BABILong task {name!r}: {e}") from None
    numbers = sorted(numbers)
    canonical = "babilong-" + "+".join(f"qa{n}" for n in numbers) + f"-{length_label(tokens)}"
    return BabilongTask(numbers[0], tokens, canonical, tuple(numbers))


# ----------------------------------------------------------------------------------- background

# bAbI's actors across its 20 tasks (people, and the animals of tasks 15 and 16).
BABI_NAMES = frozenset(
    "Mary John Sandra Daniel Fred Bill Jeff Julie Emily Winona Gertrude Jessica Lily Bernhard "
    "Greg Brian Julius Yann Jason Antoine Sumit".split())
_SUBJECT = r"(?:[A-Z][a-z]+|[Tt]he \w+|[Hh]e|[Ss]he|[Tt]hey|I|[Ww]e|[Yy]ou)"
_MOVE = re.compile(
    rf"{_SUBJECT} (?:\w+ )?(?:went|moved|journeyed|travell?ed|ran|walked|came|returned|"
    r"got|grabbed|picked up|took|dropped|discarded|put down|left|handed|gave|passed)\b"
    r"[\w ,]*?\b(?:to|into|in|from|at|up|down|the|there)\b[\w ,]*[.!]?\Z")
_WHERE = re.compile(rf"{_SUBJECT} is (?:no longer |either |not |now )?(?:in|at) the \w+"
                    r"(?: or the \w+)?[.!]?\Z")
_BABI_LIKE_WORDS = 10  # a sentence this short that moves someone or places them is bAbI-like


def is_babi_like(sentence: str) -> bool:
    """Whether a sentence could pass for a bAbI fact: it names a bAbI actor (``BABI_NAMES``), or
    it is short (at most 10 words) and just moves someone or something ("Mary went to the
    kitchen.", "He took the apple there.") or says where they are ("She is in the garden.")."""
    words = re.findall(r"[A-Za-z]+", sentence)
    if any(word in BABI_NAMES for word in words):
        return True
    text = " ".join(sentence.split()).strip("\"' ")
    return len(words) <= _BABI_LIKE_WORDS and bool(_MOVE.match(text) or _WHERE.match(text))


_ABBREVIATIONS = frozenset("mr mrs messrs dr st mt vol chap ch etc vs".split())
_HEADING = re.compile(r"(?:CHAPTER\b|--\(THE END\)--)|[^a-z]*\Z")
_FOOTNOTE = re.compile(r"\[Footnote[^\]]*\]")
_MARKER = re.compile(r"\s?\[(?:[A-Z]|\d{1,2})\]")
_END_PUNCT = ".!?"
_CLOSERS = "\"')]"


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs of a book: blank lines, headings (no lower-case letter, or "CHAPTER"),
    indented verse lines and short lines that end a sentence close a paragraph; headings and
    verse are dropped; footnotes and their markers are removed."""
    paragraphs, current = [], []

    def close():
        if current:
            paragraph = _MARKER.sub("", _FOOTNOTE.sub("", " ".join(current)))
            paragraphs.append(" ".join(paragraph.split()))
            current.clear()

    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or line.startswith("  ") or _HEADING.match(stripped):
            close()
            continue
        current.append(stripped)
        if len(stripped) < 50 and stripped[-1] in _END_PUNCT + _CLOSERS:
            close()
    close()
    return paragraphs


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of one paragraph. A sentence ends at ``.``, ``!`` or ``?`` (with any closing
    quotes and brackets after it) outside quotation marks, before a capital letter or an opening
    quote, unless the word before it is an abbreviation ("Mr.") or an initial ("K.", not "I.").
    Apostrophes inside words ("don't") are not quotation marks."""
    sentences, start, i, n = [], 0, 0, len(paragraph)
    in_double = in_single = False
    while i < n:
        c = paragraph[i]
        before = paragraph[i - 1] if i > 0 else " "
        after = paragraph[i + 1] if i + 1 < n else " "
        if c == '"':
            in_double = not in_double
        elif c == "'" and not (before.isalpha() and after.isalpha()):
            if not in_single and before in " (-" and (after.isalpha() or after in "\"("):
                in_single = True
            elif in_single and (after.isspace() or after in ",.;:!?)-\""):
                in_single = False
        elif c in _END_PUNCT:
            j = i
            while j < n and paragraph[j] in _END_PUNCT:
                j += 1
            while j < n and paragraph[j] in _CLOSERS:
                if paragraph[j] == '"':
                    in_double = not in_double
                elif paragraph[j] == "'":
                    in_single = False
                j += 1
            rest = paragraph[j:].lstrip()
            word = re.search(r"([A-Za-z]+)\W*\Z", paragraph[start:i])
            abbreviation = word is not None and c == "." and (
                word.group(1).lower() in _ABBREVIATIONS or (len(word.group(1)) == 1 and word.group(1) != "I"))
            starts = bool(rest) and (rest[0].isupper() or (rest[0] in "\"'(" and rest[1:2].isupper()))
            if not (in_double or in_single) and not abbreviation and (starts or not rest):
                sentences.append(paragraph[start:j].strip())
                start = j
                in_double = in_single = False
            i = j
            continue
        i += 1
    tail = paragraph[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def _keep(sentence: str) -> bool:
    words = sentence.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or sentence[-1] not in _END_PUNCT + _CLOSERS:
        return False
    if sentence.count('"') % 2 or not re.search(r"[a-z]", sentence):
        return False
    return not is_babi_like(sentence)


def background_files(background_dir: str | os.PathLike | None = None) -> list[Path]:
    """The background books (``*.txt``, in name order) of ``background_dir`` (default
    the shipped ``data/background``)."""
    folder = Path(background_dir) if background_dir is not None else data_root() / "background"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no background text (*.txt) in {folder}")
    return files


@functools.lru_cache(maxsize=16)
def _book_sentences(path: str, mtime_ns: int, size: int) -> tuple[str, ...]:
    text = Path(path).read_text(encoding="utf-8")
    return tuple(s for p in _paragraphs(text) for s in split_sentences(p) if _keep(s))


@functools.lru_cache(maxsize=16)
def _background(folder: str, split: str, stamp: tuple) -> tuple[BackgroundSentence, ...]:
    low, high = SPLIT_FRACTIONS[split]
    out = []
    for path, mtime_ns, size in stamp:
        sentences = _book_sentences(path, mtime_ns, size)
        first, last = round(low * len(sentences)), round(high * len(sentences))
        out += [BackgroundSentence(Path(path).name, index, sentences[index])
                for index in range(first, last)]
    return tuple(out)


def _stamp(files: Sequence[Path]) -> tuple:
    return tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; available: {', '.join(_SPLITS)}")


def background_sentences(split: str, background_dir: str | os.PathLike | None = None
                         ) -> tuple[BackgroundSentence, ...]:
    """The background sentences of a split, book after book, each in text order: the kept
    sentences of each book between the split's fractions (``SPLIT_FRACTIONS``)."""
    _check_split(split)
    files = background_files(background_dir)
    return _background(str(files[0].parent), split, _stamp(files))


@functools.lru_cache(maxsize=16)
def _sha256_cached(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def background_key(background_dir: str | os.PathLike | None = None) -> dict:
    """``{"background": [file names], "background_sha256": 16 hex of (names, contents)}``."""
    files = background_files(background_dir)
    h = hashlib.sha256()
    for path, mtime_ns, size in _stamp(files):
        h.update(Path(path).name.encode() + b"\0" + _sha256_cached(path, mtime_ns, size).encode())
    return {"background": [p.name for p in files], "background_sha256": h.hexdigest()[:16]}


# ------------------------------------------------------------------------------------ tokenizer

_TOKENIZER_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SENTENCE_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_key(tokenizer) -> str:
    """16 hex naming a tokenizer's behaviour: its class and, for a fast tokenizer, its whole
    serialised pipeline (vocabulary, merges, normaliser), else its vocabulary and special
    tokens. Cached per tokenizer object (add tokens to a new tokenizer, not to one in use)."""
    try:
        return _TOKENIZER_KEYS[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str()
    else:
        payload = json.dumps({"vocab": sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]),
                              "special": sorted(map(str, tokenizer.all_special_tokens))},
                             ensure_ascii=False)
    h = hashlib.sha256(type(tokenizer).__name__.encode() + b"\0" + payload.encode())
    key = h.hexdigest()[:16]
    try:
        _TOKENIZER_KEYS[tokenizer] = key
    except TypeError:
        pass
    return key


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _sentence_tokens(tokenizer, background: tuple[BackgroundSentence, ...]) -> list[int]:
    """Tokens of " " + each sentence, the cost of appending it to a text; cached per tokenizer."""
    try:
        cache = _SENTENCE_TOKENS.setdefault(tokenizer, {})
    except TypeError:
        cache = {}
    if background not in cache:
        ids = tokenizer([" " + s.text for s in background], add_special_tokens=False)["input_ids"]
        cache[background] = [len(x) for x in ids]
    return cache[background]


# -------------------------------------------------------------------------------------- contexts

def story_sentences(context: str) -> list[str]:
    """A bAbI context (statements joined by spaces, each ending with ".", "!" or "?") as its
    list of statements, in order."""
    return [s for s in re.split(r"(?<=[.!?])\s+", context.strip()) if s]


def story_spans(context: str, story: Sequence[str]) -> list[tuple[int, int]]:
    """Character spans ``(start, end)`` of the story's sentences in a context `babilong_context`
    built from them, in order (the sentences are inserted verbatim, whitespace normalised).

    Raises:
        ValueError: a sentence is not in the context after the previous one.
    """
    spans, at = [], 0
    for sentence in story:
        sentence = " ".join(str(sentence).split())
        start = context.find(sentence, at)
        if start < 0:
            raise ValueError(f"story sentence {sentence!r} is not in the context after character {at}")
        spans.append((start, start + len(sentence)))
        at = start + len(sentence)
    return spans


def story_token_mask(context: str, story: Sequence[str], tokenizer) -> list[bool]:
    """For each token of ``context`` (``add_special_tokens=False``, as the sender reads it),
    whether its characters overlap one of the story's sentences (`story_spans`; a word's token
    often starts at the space before it).

    Raises:
        ValueError: a slow tokenizer (no character offsets), or a sentence not in the context.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError("story token masks need a fast tokenizer (character offsets)")
    spans = story_spans(context, story)
    offsets = tokenizer(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    mask, k = [], 0
    for start, end in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        mask.append(k < len(spans) and start < spans[k][1] and end > spans[k][0])  # overlaps the sentence
    return mask


def _assemble(story: Sequence[str], background: Sequence[str], draws: Sequence[float]) -> str:
    """The story's sentences placed among the background sentences: sentence k of the story at
    boundary floor(draws[k] * (len(background) + 1)); draws sorted, so the order is kept."""
    slots: list[list[str]] = [[] for _ in range(len(background) + 1)]
    for sentence, u in zip(story, draws):
        slots[min(int(u * (len(background) + 1)), len(background))].append(sentence)
    parts = []
    for i, slot in enumerate(slots):
        parts += slot
        if i < len(background):
            parts.append(background[i])
    return " ".join(parts)


def babilong_context(story: Sequence[str], length: int, tokenizer=None, *, split: str = "train",
                     seed: int | str = 0,
                     background_dir: str | os.PathLike | None = None) -> str:
    """One long context: ``story`` (its sentences, in order) among background prose, about
    ``length`` tokens of ``tokenizer`` (the module docstring states the rule: never more than
    ``length``, short of it by less than a sentence that did not fit).

    Args:
        story: the bAbI statements in order (`story_sentences` of a bAbI context).
        length: target tokens; 0 gives the plain story joined by spaces.
        tokenizer: the LM's Hugging Face tokenizer (needed when ``length > 0``).
        split: "train", "validation" or "test": which background passages are read.
        seed: any int or string; with the other arguments it fixes the text (the task loader
            passes ``"<seed>/<row id>"``).
        background_dir: a folder of ``*.txt`` books instead of the shipped ones.

    Raises:
        ValueError: a bad length or split, no tokenizer, or a split whose background is too
            short for ``length``.
    """
    _check_split(split)
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise ValueError(f"length must be an int >= 0 (tokens), got {length!r}")
    story = [" ".join(str(s).split()) for s in story]
    plain = " ".join(story)
    if length == 0:
        return plain
    if tokenizer is None:
        raise ValueError("a BABILong context longer than 0 needs the LM's tokenizer (tokenizer=)")
    story_tokens = _count(tokenizer, plain)
    if story_tokens >= length:
        return plain
    background = background_sentences(split, background_dir)
    costs = _sentence_tokens(tokenizer, background)
    if sum(costs) + story_tokens < length:
        raise ValueError(f"the {split} background has about {sum(costs)} tokens, too few for "
                         f"a context of {length} tokens")
    rng = random.Random(f"ilcp-babilong/{split}/{seed}")
    first = rng.randrange(len(background))
    draws = sorted(rng.random() for _ in story)

    def walk(budget: int) -> list[int]:
        chosen, used, misses = [], 0, 0
        for step in range(len(background)):
            index = (first + step) % len(background)
            if used + costs[index] <= budget:
                chosen.append(index)
                used += costs[index]
                misses = 0
            else:
                misses += 1
            if budget - used < MIN_GAP or misses >= LOOKAHEAD:
                break
        return chosen

    # The per-sentence costs add up to the text's tokens up to a few merges at the joins: walk
    # with them, count the text, and walk again with the budget corrected by the difference,
    # keeping the longest text that fits.
    budget, best, best_tokens = length - story_tokens, plain, story_tokens
    for _ in range(3):
        chosen = walk(budget)
        text = _assemble(story, [background[i].text for i in chosen], draws)
        tokens = _count(tokenizer, text)
        while tokens > length and chosen:  # too long by the merges: drop background at the end
            chosen.pop()
            text = _assemble(story, [background[i].text for i in chosen], draws)
            tokens = _count(tokenizer, text)
        if best_tokens < tokens <= length:
            best, best_tokens = text, tokens
        error = tokens - (story_tokens + sum(costs[i] for i in chosen))
        if error == 0 or length - best_tokens < MIN_GAP:
            break
        budget -= error
    return best


# ---------------------------------------------------------------------------------- the task
