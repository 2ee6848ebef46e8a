"""Argument checks shared across the package: one wording for one mistake."""

from __future__ import annotations


def positive_int(name: str, value) -> int:
    """`value` as an int when it is a positive int (not a bool); else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_key(key) -> bytes:
    """`key` as bytes when it can be a shared key (bytes, at least 16 of them); else ValueError."""
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise ValueError("an authentication key must be bytes of length >= 16 (e.g. secrets.token_bytes(32))")
    return bytes(key)


# No tokenizer this package meets averages more characters per token than this on any text
# (English prose runs at about 4): a text longer than limit x this cannot fit in `limit` tokens,
# and is refused before it is tokenised.
CHARS_PER_TOKEN = 32


def text_length(name: str, characters: int, max_tokens: int | None) -> None:
    """ValueError naming `name` when ``characters`` exceed what ``max_tokens`` tokens can hold
    (``max_tokens x CHARS_PER_TOKEN``); nothing when ``max_tokens`` is None. The one wording of
    this bound, for a text (`text_input`) or the texts of chat messages together."""
    if max_tokens is not None and characters > max_tokens * CHARS_PER_TOKEN:
        raise ValueError(f"{name} has {characters:,} characters, more than {max_tokens} tokens can hold (at most "
                         f"{max_tokens * CHARS_PER_TOKEN:,}: {max_tokens} tokens x {CHARS_PER_TOKEN} characters): "
                         f"shorten it")


def text_input(name: str, text: str, max_tokens: int | None = None) -> str:
    """A string that a tokenizer can take: valid Unicode (no lone surrogate such as ``"\\ud800"``),
    and, when ``max_tokens`` is given, at most ``max_tokens x CHARS_PER_TOKEN`` characters (checked
    before any tokenising, so an overlong text is refused at once). ValueError naming `name`."""
    text_length(name, len(text), max_tokens)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} is not valid Unicode text: it holds a lone surrogate "
                         f"{text[e.start]!r} at character {e.start}") from None
    return text
