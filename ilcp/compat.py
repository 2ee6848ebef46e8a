"""The one place that knows how transformers versions differ.

transformers 5.x renamed the key/value cache of model forwards: ``forward(..., cache=...)``
returning ``outputs.cache`` (5.24; the old ``past_key_values`` name is still accepted with a
deprecation warning until 5.40). transformers 4.57, which the vLLM environment pins, only knows
``forward(..., past_key_values=...)`` returning ``outputs.past_key_values``. Every other module
builds its forward arguments and reads caches through the helpers below, so a version bump is a
change to this file alone. Decisions are made by inspecting a model class's forward signature
(once per class), not by comparing version strings, so wrappers that follow either convention
work too.
"""

from __future__ import annotations

import functools
import inspect

from torch import nn

_CACHE_NAMES = ("cache", "past_key_values")


@functools.lru_cache(maxsize=None)
def _forward_parameters(model_class: type) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(model_class.forward).parameters)
    except (TypeError, ValueError):  # builtins or odd wrappers: nothing to inspect
        return frozenset()


@functools.lru_cache(maxsize=None)
def cache_argument_name(model_class: type) -> str:
    """The forward keyword that takes the key/value cache: ``"cache"`` (5.x) or ``"past_key_values"``."""
    params = _forward_parameters(model_class)
    for name in _CACHE_NAMES:
        if name in params:
            return name
    # A forward that only takes **kwargs: follow the installed library's convention.
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_kwargs(model: nn.Module, cache) -> dict:
    """``{name: cache}`` for ``model(**inputs, **cache_kwargs(model, cache))``."""
    return {cache_argument_name(type(model)): cache}


def output_cache(outputs):
    """The key/value cache a forward returned (``outputs.cache`` or ``outputs.past_key_values``).

    Reads the field without touching deprecated properties, so no warning is logged.
    """
    fields = getattr(outputs, "__dataclass_fields__", {})
    for name in _CACHE_NAMES:
        if name in fields:
            return getattr(outputs, name)
    if isinstance(outputs, dict):
        for name in _CACHE_NAMES:
            if name in outputs:
                return outputs[name]
    raise ValueError(f"{type(outputs).__name__} carries no key/value cache (was use_cache=True passed?)")


def new_dynamic_cache(model: nn.Module):
    """An empty `DynamicCache` for ``model`` (built from its config where the class accepts one,
    which sizes sliding-window layers correctly)."""
    from transformers import DynamicCache

    params = _init_parameters(DynamicCache)
    config = getattr(model, "config", None)
    if "config" in params and hasattr(config, "get_text_config"):  # a transformers config
        return DynamicCache(config=config)
    return DynamicCache()


@functools.lru_cache(maxsize=None)
def _init_parameters(cls: type) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return frozenset()


def logits_to_keep_kwargs(model: nn.Module, n: int) -> dict:
    """Ask the forward for the logits of the last ``n`` positions only, where it supports that
    (``logits_to_keep``; ``num_logits_to_keep`` in older releases); ``{}`` otherwise."""
    params = _forward_parameters(type(model))
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return {name: n}
    return {}


def output_cache_or_none(outputs):
    """Like `output_cache`, but None when ``outputs`` has no cache field or it is empty (e.g. a
    ``generate`` output without a cache)."""
    try:
        return output_cache(outputs)
    except ValueError:
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
    import copy

    return copy.deepcopy(cache)


def crop_cache(cache, length: int) -> None:
    """Keep the first ``length`` positions of ``cache`` in place.

    Uses the negative form of ``Cache.crop`` (tokens to remove), which every supported version
    accepts; 5.x rejects the positive (absolute length) form.
    """
    remove = cache_length(cache) - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache_length(cache)} positions to {length}")
    if remove > 0:
        cache.crop(-remove)


def cache_tensors(cache):
    """Per-layer ``(keys, values)`` [batch, kv_heads, positions, head_dim], or None when the cache
    class exposes neither ``layers`` (4.56+) nor ``key_cache``/``value_cache`` (older)."""
    import torch

    layers = getattr(cache, "layers", None)
    if layers is not None:
        pairs = [(getattr(layer, "keys", None), getattr(layer, "values", None)) for layer in layers]
        if all(isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) for k, v in pairs):
            return pairs
        return None
    keys, values = getattr(cache, "key_cache", None), getattr(cache, "value_cache", None)
    if keys is not None and values is not None:
        return list(zip(keys, values))
    return None


def use_attention(model: nn.Module, name: str, forward) -> bool:
    """Register ``forward`` as transformers attention function ``name`` (its masks built as for
    SDPA) and switch ``model`` to it, where the model runs SDPA now.

    Returns False, leaving the model as it is, where the model runs another attention (eager,
    flash) or this transformers has no attention registry (before 4.53).
    """
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    config._attn_implementation = name
    return True
