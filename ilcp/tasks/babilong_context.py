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

Background: the sentences of `ilcp.tasks.background` (public-domain books; each split reads its
own passages). Everything is deterministic for (story, length, tokenizer, split, seed).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import weakref
from collections.abc import Sequence

from .background import BackgroundSentence, background_sentences, check_background_split

# Bump when babilong_context, the sentence splitter or the filters would give other text.
GENERATOR_VERSION = 1
MIN_GAP = 4     # tokens of slack at which the background walk stops
LOOKAHEAD = 64  # sentences in a row that may not fit before the walk stops


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
    check_background_split(split)
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
