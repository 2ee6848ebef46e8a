"""QSnap: SnapKV with the request as the observation window."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ilcp.checks import positive_int
from ilcp.rclc.selectors.base import AttentionProfile, Selector


@dataclass
class QSnap(Selector):
    """The request's attention to each sender position (averaged over request queries, heads and
    layers, sink window excluded), smoothed by a 1-D average pool of ``kernel_size``; top-k.

    Attributes:
        kernel_size: odd width of the smoothing pool.
    """

    kernel_size: int = 5

    def __post_init__(self) -> None:
        if positive_int("kernel_size", self.kernel_size) % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int, got {self.kernel_size}")

    def score(self, profile: AttentionProfile) -> torch.Tensor:
        """[T] smoothed request attention."""
        return smooth(profile.request, self.kernel_size)


def smooth(scores: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """Average pool of width ``kernel_size`` over [T] scores, same length, no padding counted."""
    if kernel_size == 1:
        return scores.clone()
    pooled = F.avg_pool1d(scores.view(1, 1, -1), kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=False)
    return pooled.view(-1)
