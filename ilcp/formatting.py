"""How every table in the package writes a number: one place, so results.md, the console summary,
the sweep's sweep.md and the docs/results pages agree to the character.

- `percent`: a fraction as a percentage with one decimal, and its interval when given
  (``percent(0.5, (0.4, 0.6))`` -> ``"50.0 [40.0, 60.0]"``; ``unit="%"`` -> ``"50.0% [40.0, 60.0]"``);
- `byte_count`: a byte count with thousands separators, one decimal when it is not whole (a mean
  over requests), or always rounded with ``whole=True``.
Both write ``-`` for a missing value (None).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["byte_count", "percent"]


def percent(point: float | None, ci: Sequence[float] | None = None, *, unit: str = "") -> str:
    """``point`` (a fraction) as a percentage, followed by ``[low, high]`` when ``ci`` is given."""
    if point is None:
        return "-"
    text = f"{100 * point:.1f}{unit}"
    return f"{text} [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]" if ci else text


def byte_count(x: float | None, *, whole: bool = False) -> str:
    """``x`` bytes as ``1,234`` (``1,234.5`` for a fraction, unless ``whole``)."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if whole or float(x).is_integer() else f"{x:,.1f}"
