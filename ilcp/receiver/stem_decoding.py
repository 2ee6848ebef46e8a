"""Greedy decoding after a shared stem: the key/value cache of the part of the receiver's prefix
that every question shares (`ilcp.receiver.prefix.question_stem`: the memory and the prompt
before the question) is computed once, and each question prefills only its own positions.

    cache = prefill_stem(model, stem_rows)                        # (S, H) -> a batch-1 cache
    greedy_after_stem(model, tok, cache, S, [rest_rows, ...], max_new_tokens=8,
                      stop_at_newline=False, stops=stop_token_ids(model, tok))

A batch of questions gets a copy of the stem's cache, repeated once per row (the stem's cache
itself is never written), then one prefill over its rests, left padded against the stem: the
padding stands between the stem and each rest, masked out, and every real position keeps the
position id it has in the whole prefix, so a row decodes what `greedy_decode` decodes from its
whole prefix (up to floating-point rounding). The model is frozen: nothing here changes it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ilcp import compat

from .decoding import greedy_steps

__all__ = ["batch_copy", "greedy_after_stem", "prefill_stem"]


def _device_and_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    weight = model.get_input_embeddings().weight
    return weight.device, weight.dtype


def prefill_stem(model: nn.Module, stem: Tensor):
    """The key/value cache (batch 1) of a stem's rows (S, H), at positions 0..S-1."""
    if not isinstance(stem, Tensor) or stem.dim() != 2 or stem.shape[0] == 0:
        raise ValueError(f"a stem must be a non-empty (S, H) tensor, got {getattr(stem, 'shape', type(stem))}")
    device, dtype = _device_and_dtype(model)
    length = stem.shape[0]
    cache = compat.new_dynamic_cache(model)
    with torch.inference_mode():
        out = model(
            inputs_embeds=stem.to(device=device, dtype=dtype)[None],
            attention_mask=torch.ones(1, length, dtype=torch.long, device=device),
            position_ids=torch.arange(length, device=device)[None],
            use_cache=True,
            **compat.cache_kwargs(model, cache),
            **compat.logits_to_keep_kwargs(model, 1),
        )
    return compat.output_cache(out)


def batch_copy(cache, rows: int):
    """A copy of a batch-1 cache that shares nothing with it, repeated to ``rows`` rows."""
    copy = compat.clone_cache(cache)
    if rows > 1:
        copy.batch_repeat_interleave(rows)
    return copy


def greedy_after_stem(model: nn.Module, tokenizer, cache, stem_length: int, rests: Sequence[Tensor], *,
                      max_new_tokens: int, stop_at_newline: bool, stops) -> list[list[int]]:
    """Greedy answer ids (stop tokens excluded) of one batch of rests (n_i, H) that follow a stem
    of ``stem_length`` positions whose batch-1 cache is ``cache`` (`prefill_stem`, left as it is).
    The caller has checked that each whole prefix plus ``max_new_tokens`` fits the LM."""
    if not rests or any(r.dim() != 2 or r.shape[0] == 0 for r in rests):
        raise ValueError("rests must be a non-empty list of non-empty (n, H) tensors")
    device, dtype = _device_and_dtype(model)
    batch, width = len(rests), max(r.shape[0] for r in rests)
    hidden = rests[0].shape[1]
    inputs = torch.zeros(batch, width, hidden, dtype=dtype, device=device)
    rest_mask = torch.zeros(batch, width, dtype=torch.long, device=device)
    for i, rest in enumerate(rests):
        inputs[i, width - rest.shape[0]:] = rest.to(device=device, dtype=dtype)
        rest_mask[i, width - rest.shape[0]:] = 1
    positions = (stem_length + rest_mask.cumsum(-1) - 1).masked_fill(rest_mask == 0, 1)
    mask = torch.cat([torch.ones(batch, stem_length, dtype=torch.long, device=device), rest_mask], dim=1)
    with torch.inference_mode():
        rows_cache = batch_copy(cache, batch)
        out = model(
            inputs_embeds=inputs,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **compat.cache_kwargs(model, rows_cache),
            **compat.logits_to_keep_kwargs(model, 1),
        )
        token = out.logits[:, -1, :].argmax(dim=-1)
        ids, _ = greedy_steps(model, tokenizer, compat.output_cache(out), token, mask, positions[:, -1:],
                               max_new_tokens, stop_at_newline, stops)
    return ids
