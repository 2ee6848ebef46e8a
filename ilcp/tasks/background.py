"""Background prose for BABILong contexts (`ilcp.tasks.babilong_context`): the books, their
sentences and each split's share of them.

The books under ``data/background/`` (`ilcp.datadir`) (public domain; see the README there) are
split into sentences; sentences that read like bAbI facts (`is_babi_like`) and very short or
long ones are dropped. Each book's kept sentences are cut into three contiguous passages, the
first 80% for the train split, the next 10% for validation and the last 10% for test, so the
splits never share background text. A change that gives other sentences bumps
`ilcp.tasks.babilong_context.GENERATOR_VERSION`.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from ..datadir import data_root

# Each book's kept sentences, in order, are cut at these fractions into train / validation / test.
SPLIT_FRACTIONS = {"train": (0.0, 0.8), "validation": (0.8, 0.9), "test": (0.9, 1.0)}
MIN_WORDS, MAX_WORDS = 5, 48  # background sentences kept

_SPLITS = tuple(SPLIT_FRACTIONS)


class BackgroundSentence(NamedTuple):
    """One background sentence: its ``source`` file, its ``index`` among that file's kept
    sentences (its position in the book), and its ``text``."""

    source: str
    index: int
    text: str


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


def check_background_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"unknown split {split!r}; available: {', '.join(_SPLITS)}")


def background_sentences(split: str, background_dir: str | os.PathLike | None = None
                         ) -> tuple[BackgroundSentence, ...]:
    """The background sentences of a split, book after book, each in text order: the kept
    sentences of each book between the split's fractions (``SPLIT_FRACTIONS``)."""
    check_background_split(split)
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
