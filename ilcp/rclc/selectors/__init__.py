"""Built-in selectors and the selector contract (see `ilcp.rclc.selectors.base`).

``cacheback`` (the default), ``qsnap``, ``chunkkv``, ``sentences``, ``reread`` and ``overlap`` are ready-made instances; build your own
settings from the classes, e.g. ``CacheBack(window=8)``.
"""

from ilcp.rclc.selectors.base import (
    AttentionProfile,
    Selector,
    attention_profile,
    is_builtin,
    select_groups,
    validate_positions,
)
from ilcp.rclc.selectors.cacheback import CacheBack
from ilcp.rclc.selectors.chunkkv import ChunkKV
from ilcp.rclc.selectors.overlap import Overlap
from ilcp.rclc.selectors.qsnap import QSnap
from ilcp.rclc.selectors.reread import Reread
from ilcp.rclc.selectors.sentences import Sentences

cacheback = CacheBack()
qsnap = QSnap()
chunkkv = ChunkKV()
sentences = Sentences()
reread = Reread()
overlap = Overlap()
DEFAULT_SELECTOR = cacheback

__all__ = [
    "AttentionProfile", "CacheBack", "ChunkKV", "DEFAULT_SELECTOR", "Overlap", "QSnap", "Reread", "Selector",
    "Sentences", "attention_profile", "cacheback", "chunkkv", "is_builtin", "overlap", "qsnap", "reread",
    "select_groups", "sentences", "validate_positions",
]
