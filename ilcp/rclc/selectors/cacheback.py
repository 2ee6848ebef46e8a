"""CacheBack (the default selector): the request's attention and the attention the sender's own
last positions pay, looking back from the end of the cache, combined and kept in spans."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ilcp.checks import positive_int
from ilcp.rclc.selectors.base import AttentionProfile, Selector


@dataclass
class CacheBack(Selector):
    """Scores: ``max(request / max(request), tail / max(tail))`` where ``request`` is QSnap's
    (unsmoothed) request attention and ``tail`` the attention of the sender's last
    ``tail_queries`` positions; selection in spans of ``window`` consecutive positions scored by
    their maximum, so kept rows keep their neighbours.

    Attributes:
        window: span width W.
        tail_queries: how many of the sender's final positions look back over the cache.
    """

    window: int = 4
    tail_queries: int = 16

    def __post_init__(self) -> None:
        positive_int("window", self.window)
        if self.tail_queries < 0:
            raise ValueError(f"tail_queries must be >= 0, got {self.tail_queries}")
        self.group_size = self.window

    def score(self, profile: AttentionProfile) -> torch.Tensor:
        """[T] combined, per-source normalised scores."""
        return torch.maximum(_normalise(profile.request), _normalise(profile.tail))


def _normalise(scores: torch.Tensor) -> torch.Tensor:
    peak = scores.max()
    return scores / peak if float(peak) > 0 else scores.clone()
