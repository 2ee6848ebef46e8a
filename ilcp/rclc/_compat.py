"""Transformers-version differences the RCLC code depends on, in one private place.

Transformers 5.x passes the KV cache to ``forward`` as ``cache=`` and returns it as
``outputs.cache``; 4.57 used ``past_key_values=`` for both. The keyword is decided by inspecting
the model's forward signature, never by comparing version strings.
"""

from __future__ import annotations

import copy
import inspect

import torch
from torch import nn

_CACHE_NAMES = ("cache", "past_key_values")


def cache_kwarg(model: nn.Module) -> str:
    """Name of the forward keyword that takes the KV cache: ``"cache"`` or ``"past_key_values"``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    for name in _CACHE_NAMES:
        if name in params:
            return name
    return "past_key_values"


def output_cache(outputs):
    """The KV cache returned by a forward or by ``generate(return_dict_in_generate=True)``, or None."""
    for name in _CACHE_NAMES:
        value = getattr(outputs, name, None)
        if value is not None:
            return value
    return None


def cache_length(cache) -> int:
    """Number of cached positions (0 for None)."""
    if cache is None:
        return 0
    if not hasattr(cache, "get_seq_length"):
        raise TypeError(f"expected a transformers Cache object, got {type(cache).__name__}")
    return int(cache.get_seq_length())


def clone_cache(cache):
    """A deep copy that shares no tensor storage with ``cache``."""
    return copy.deepcopy(cache)


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` in place.

    Uses the negative form of ``Cache.crop`` (tokens to remove), which every supported
    version accepts; 5.x rejects the positive (absolute length) form.
    """
    remove = cache_length(cache) - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} positions to {length}")
    if remove > 0:
        cache.crop(-remove)


def cache_tensors(cache):
    """Per-layer ``(keys, values)`` [batch, kv_heads, positions, head_dim], or None when the cache
    class exposes neither ``layers`` (4.56+) nor ``key_cache``/``value_cache`` (older)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        pairs = [(getattr(l, "keys", None), getattr(l, "values", None)) for l in layers]
        if all(isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) for k, v in pairs):
            return pairs
        return None
    keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if keys is not None and values is not None:
        return list(zip(keys, values))
    return None
