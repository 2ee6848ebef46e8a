"""Recompute the frozen LM's layers in the backward pass instead of keeping their activations.

A stage that trains through the receiver (a memory, a soft prompt) keeps, for its backward pass,
every intermediate tensor of every layer of the frozen LM: about 50 KB a token a layer in float32
for SmolLM2, so 8 rows of 170 tokens hold about 2 GB. With ``trainer.recompute_layers`` each
decoder layer keeps its input alone and runs again during the backward pass (non-reentrant
`torch.utils.checkpoint`): the peak falls to about one layer's activations, for about a third
more compute a step.

The layers are wrapped for the duration of one forward (`recomputing`) and restored after it, as
instance attributes over their own ``forward``: the LM object other users hold is unchanged
outside it. Only a forward without a key/value cache may be wrapped: a layer that writes a
cache would write it twice.
"""

from __future__ import annotations

import contextlib
import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["decoder_layers", "recomputing"]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The LM's list of decoder layers: the largest ``nn.ModuleList`` named ``...layers``."""
    found = [m for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] == "layers"]
    if not found:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers (a ModuleList named 'layers')")
    return max(found, key=len)


def _recomputed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return run


@contextlib.contextmanager
def recomputing(model: nn.Module, enabled: bool = True):
    """While inside (and `enabled`), each decoder layer of `model` keeps only its input for the
    backward pass and recomputes the rest there. Forwards inside must not use a key/value cache."""
    if not enabled:
        yield
        return
    layers = list(decoder_layers(model))
    try:
        for layer in layers:
            layer.forward = _recomputed(layer.forward)
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
