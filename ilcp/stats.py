"""The statistics every report uses: intervals of an accuracy or a mean, and latency percentiles.

- `wilson_interval`: the 95% Wilson score interval of a proportion (0/1 outcomes);
- `bootstrap_interval`: a seeded percentile bootstrap of a mean (for quantities that are not 0/1);
- `latency_summary`: n, p50, p99 and mean of per-request seconds;
- `mean`: the mean of a list, None for an empty one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["bootstrap_interval", "latency_summary", "mean", "wilson_interval"]


def wilson_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float] | None:
    """Wilson score interval of a proportion (values are 0/1 outcomes).

    Unlike the percentile bootstrap it does not collapse to [0, 0] at 0 hits or [1, 1] at all
    hits: 0 of 200 gives [0.0, 0.019].

    Returns:
        (low, high), or None for no values.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return None
    if not np.isin(x, (0.0, 1.0)).all():
        raise ValueError("a Wilson interval is for 0/1 outcomes")
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    n, p = x.size, float(x.mean())
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, min(p, centre - half)), min(1.0, max(p, centre + half))


def bootstrap_interval(values: Sequence[float], *, resamples: int = 1000, level: float = 0.95,
                       seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of ``values`` (seeded, so reproducible).

    Returns:
        (low, high), or None for no values.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return None
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    tail = (1.0 - level) / 2.0 * 100.0
    low, high = np.percentile(means, [tail, 100.0 - tail])
    return float(low), float(high)


def latency_summary(seconds: Sequence[float]) -> dict:
    """{"n", "p50", "p99", "mean"} in seconds (None when no request was timed).

    With few requests p99 is close to the slowest one; ``n`` says how many there were.
    """
    x = np.asarray(seconds, dtype=np.float64)
    if x.size == 0:
        return {"n": 0, "p50": None, "p99": None, "mean": None}
    return {"n": int(x.size), "p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)),
            "mean": float(x.mean())}


def mean(x: Sequence[float]) -> float | None:
    return sum(x) / len(x) if x else None
