"""Built-in selectors and the selector contract (see `ilcp.rclc.selectors.base`).

Every selector registered in `ilcp.names.SELECTORS` (``cacheback``, the default, and the others)
is a ready-made instance here under its name, e.g. ``rclc.selectors.qsnap``, and in `BY_NAME`;
build your own settings from the classes, e.g. ``CacheBack(window=8)``. A new built-in selector
is its module in this package and one entry in `ilcp.names.SELECTORS`.
"""

from ilcp.names import DEFAULT_SELECTOR as _DEFAULT_NAME
from ilcp.names import SELECTORS as _REGISTERED
from ilcp.names import resolve as _resolve
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

BY_NAME: dict[str, Selector] = {name: _resolve(entry.target)() for name, entry in _REGISTERED.items()}
"""Name -> the ready-made instance (default settings) of each registered selector, in registry order."""
globals().update(BY_NAME)
DEFAULT_SELECTOR = BY_NAME[_DEFAULT_NAME]

__all__ = [
    "AttentionProfile", "BY_NAME", "CacheBack", "ChunkKV", "DEFAULT_SELECTOR", "Overlap", "QSnap", "Reread",
    "Selector", "Sentences", "attention_profile", "is_builtin", "select_groups", "validate_positions", *BY_NAME,
]
