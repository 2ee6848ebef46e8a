"""ChunkKV: request attention summed over fixed chunks; whole top chunks are kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ilcp.checks import positive_int
from ilcp.rclc.selectors.base import AttentionProfile, Selector


@dataclass
class ChunkKV(Selector):
    """QSnap's request attention (unsmoothed), summed over chunks of ``chunk_size`` positions;
    the top chunks are kept whole and the last one is trimmed to its best positions to fit.

    Attributes:
        chunk_size: positions per chunk.
    """

    chunk_size: int = 10
    group_reduce = "sum"

    def __post_init__(self) -> None:
        positive_int("chunk_size", self.chunk_size)
        self.group_size = self.chunk_size

    def score(self, profile: AttentionProfile) -> torch.Tensor:
        """[T] request attention."""
        return profile.request.clone()
