"""`sender_from_hf`: a `SenderState` from a loaded Hugging Face model and its conversation."""

from __future__ import annotations

import torch
from torch import nn

from ilcp import compat
from ilcp.rclc import hf
from ilcp.rclc.runtime import MODEL_LOCK
from ilcp.rclc.state import SenderState


def sender_from_hf(
    model: nn.Module,
    tokenizer=None,
    source=None,
    *,
    generation=None,
    past_key_values=None,
) -> SenderState:
    """Build a sender from chat messages, rendered text, token IDs or a generate() output.

    Args:
        model: a causal LM in eval mode.
        tokenizer: its tokenizer (needed for messages and text).
        source: chat messages (list of {"role", "content"} dicts, templated with no new assistant
            prefix), rendered text (no special tokens added) or int64 [1, tokens] IDs.
        generation: instead of ``source``, the ``return_dict_in_generate=True`` output of a
            greedy or sampling ``model.generate`` from a token prompt; ``sequences`` [1, tokens]
            must hold the whole prompt.
        past_key_values: a cache for a prefix of the IDs. Complete: reused as is. Shorter: cloned
            and extended with the missing tokens. Longer: rejected. Never modified.

    Returns:
        SenderState with token_ids, latent_steps=0 and inherited_positions=0.

    Raises:
        ValueError / TypeError: ambiguous arguments, beam or inputs_embeds generations, a cache
        longer than the IDs, IDs outside the vocabulary, a model in training mode.
    """
    if not isinstance(model, nn.Module) or not hasattr(model, "get_input_embeddings"):
        raise TypeError(f"model must be a Hugging Face model, got {type(model).__name__}")
    if model.training:
        raise ValueError("the sender model is in training mode; call model.eval() first")
    if generation is not None:
        if source is not None or past_key_values is not None:
            raise ValueError("pass either generation=... or a source (with an optional past_key_values), not both")
        ids, cache = _from_generation(generation)
    else:
        if source is None:
            raise ValueError("pass chat messages, rendered text, int64 [1, tokens] IDs or generation=...")
        ids, cache = _source_ids(tokenizer, source, hf.text_limit(model)), past_key_values
    ids = hf.check_ids(ids, hf.vocab_size(model), "sender token IDs")
    total = ids.shape[1]
    with MODEL_LOCK:
        rows = hf.embed_ids(model, ids[0])
        cached = compat.cache_length(cache)
        if cached > total:
            raise ValueError(f"the cache holds {cached} positions, more than the {total} tokens given")
        if cache is None or cached == 0:
            cache = hf.prefill(model, rows)
        elif cached < total:
            cache = hf.prefill(model, rows[cached:], compat.clone_cache(cache))
    return SenderState(
        model=model,
        past_key_values=cache,
        input_embeds=rows,
        tokenizer=tokenizer,
        token_ids=ids[0].to(rows.device),
    )


def _source_ids(tokenizer, source, limit: int | None) -> torch.Tensor:
    if isinstance(source, torch.Tensor):
        return source
    if isinstance(source, str):
        return hf.encode_text(tokenizer, source, limit, what="the sender's text")
    if isinstance(source, (list, tuple)):
        text = hf.render_chat(tokenizer, source, add_generation_prompt=False, max_tokens=limit)
        return hf.encode_text(tokenizer, text, limit, what="the rendered chat messages")
    raise TypeError(f"source must be chat messages, text or an int64 tensor, got {type(source).__name__}")


def _from_generation(generation):
    sequences = getattr(generation, "sequences", None)
    if sequences is None or not isinstance(sequences, torch.Tensor):
        raise ValueError("generation must be the output of model.generate(..., return_dict_in_generate=True)")
    if "Beam" in type(generation).__name__ or getattr(generation, "beam_indices", None) is not None:
        raise ValueError("beam-search generations are not supported; use greedy decoding or sampling")
    if sequences.dim() != 2 or sequences.shape[0] != 1:
        raise ValueError(f"generation.sequences must be [1, tokens] (one unpadded sequence), got {tuple(sequences.shape)}")
    cache = compat.output_cache_or_none(generation)
    if cache is not None and compat.cache_length(cache) >= sequences.shape[1]:
        raise ValueError(
            "the generation's cache covers more positions than its sequences: an inputs_embeds "
            "generation (sequences lack the prompt); build a SenderState from those rows instead"
        )
    return sequences, cache
