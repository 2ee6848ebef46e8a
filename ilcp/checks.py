"""Argument checks shared across the package: one wording for one mistake."""

from __future__ import annotations


def positive_int(name: str, value) -> int:
    """`value` as an int when it is a positive int (not a bool); else ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value
