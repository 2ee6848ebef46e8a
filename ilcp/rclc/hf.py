"""The Hugging Face backend seam: every forward, embedding lookup and tokenizer call RCLC makes.

Only the public transformers API is used (``get_input_embeddings``, ``base_model``,
``inputs_embeds``, the KV cache, attention masks, ``output_attentions``/``output_hidden_states``,
``set_attn_implementation``, the config), so any dense decoder-only model works, not only Qwen3.
A different backend provides the same functions over its own model view.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
from torch import nn

from ilcp import compat
from ilcp.checks import text_input, text_length

# --------------------------------------------------------------------------------------------
# embeddings and forwards


def embedding_weight(model: nn.Module) -> torch.Tensor:
    """The input embedding table [vocab, hidden]."""
    return model.get_input_embeddings().weight


def embed_ids(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Input rows for token IDs.

    Args:
        ids: int64 [n] token IDs.
    Returns:
        [n, hidden] rows on the model's device and dtype.
    """
    weight = embedding_weight(model)
    with torch.no_grad():
        return model.get_input_embeddings()(ids.to(weight.device)).detach()


def _decoder(model: nn.Module) -> nn.Module:
    """The base model without the LM head (no logits are needed for cache or attention work)."""
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else model


def forward_rows(
    model: nn.Module,
    rows: torch.Tensor,
    cache=None,
    *,
    output_attentions: bool = False,
    output_hidden_states: bool = False,
):
    """One forward of continuous rows after an existing cache, which is extended in place.

    Args:
        rows: [n, hidden] input rows in the model's dtype.
        cache: a transformers Cache holding the preceding positions, or None for a fresh one.
    Returns:
        the base model's outputs; the (extended or new) cache is `compat.output_cache(outputs)`.
    """
    decoder = _decoder(model)
    past = compat.cache_length(cache)
    n = int(rows.shape[0])
    device = rows.device
    kwargs = {
        "inputs_embeds": rows.unsqueeze(0),
        "attention_mask": torch.ones(1, past + n, dtype=torch.long, device=device),
        "position_ids": torch.arange(past, past + n, device=device).unsqueeze(0),
        "use_cache": True,
        **compat.cache_kwargs(decoder, cache),
    }
    if output_attentions:
        kwargs["output_attentions"] = True
    if output_hidden_states:
        kwargs["output_hidden_states"] = True
    with torch.no_grad():
        return decoder(**kwargs)


def prefill(model: nn.Module, rows: torch.Tensor, cache=None):
    """Extend ``cache`` (in place; a new cache when None) with ``rows`` [n, hidden]; returns it."""
    if rows.shape[0] == 0:
        return cache
    outputs = forward_rows(model, rows, cache)
    result = compat.output_cache_or_none(outputs)
    if result is None:
        raise RuntimeError(f"{type(model).__name__} returned no KV cache with use_cache=True")
    return result


def last_hidden_row(outputs) -> torch.Tensor:
    """The final layer's hidden state at the last position, [hidden]."""
    hidden = getattr(outputs, "last_hidden_state", None)
    if hidden is None:
        hidden = outputs.hidden_states[-1]
    return hidden[0, -1]


@contextlib.contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """Switch ``model`` to eager attention (so attention weights exist) and restore it in ``finally``."""
    previous = getattr(model.config, "_attn_implementation", None)
    if previous == "eager":
        yield
        return
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"{type(model).__name__} cannot switch attention implementation; attention scores need eager attention")
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


# --------------------------------------------------------------------------------------------
# model facts


def context_limit(model: nn.Module) -> int:
    """The model's maximum number of positions (``config.max_position_embeddings``)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(limit) if limit else 1 << 31


def vocab_size(model: nn.Module) -> int:
    return int(embedding_weight(model).shape[0])


_VOCAB_HASHES: "weakref.WeakKeyDictionary[object, str]" = weakref.WeakKeyDictionary()


def tokenizer_vocab_hash(tokenizer) -> str | None:
    """Hash of a tokenizer's vocabulary and special tokens (cached per tokenizer object)."""
    if tokenizer is None:
        return None
    try:
        return _VOCAB_HASHES[tokenizer]
    except (KeyError, TypeError):
        pass
    from ilcp.lm import vocab_hash

    digest = vocab_hash(tokenizer)
    try:
        _VOCAB_HASHES[tokenizer] = digest
    except TypeError:
        pass
    return digest


def identity(model: nn.Module) -> dict:
    """What metadata can tell about a checkpoint: architecture, name, revision and widths."""
    config = getattr(model, "config", None)
    return {
        "architecture": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "name": getattr(config, "_name_or_path", None) or None,
        "revision": getattr(config, "_commit_hash", None),
        "hidden_size": int(embedding_weight(model).shape[1]),
        "vocab_size": vocab_size(model),
    }


def weights_digest(model: nn.Module) -> str:
    """`ilcp.lm.weight_hash` of a model; a model that cannot be hashed tensor by tensor (the vLLM
    shared-weight view, whose linear layers are the engine's packed kernels) carries its own
    ``_rclc_weight_digest`` callable giving the same hash from its checkpoint files."""
    digest = getattr(model, "_rclc_weight_digest", None)
    if callable(digest):
        return digest()
    from ilcp.lm import weight_hash

    return weight_hash(model)


def check_same_checkpoint(sender_model, sender_tokenizer, receiver_model, receiver_tokenizer) -> None:
    """Raise ValueError on a known architecture, checkpoint name/revision or vocabulary mismatch,
    or on weights that differ (two model objects: their weight hashes, as snapshots check them;
    each model's hash is computed once and cached)."""
    if sender_model is receiver_model and sender_tokenizer is receiver_tokenizer:
        return
    a, b = identity(sender_model), identity(receiver_model)
    for key, what in (
        ("architecture", "architecture"),
        ("model_type", "model type"),
        ("name", "checkpoint name"),
        ("revision", "checkpoint revision"),
        ("hidden_size", "hidden size"),
        ("vocab_size", "vocabulary size"),
    ):
        if a[key] is not None and b[key] is not None and a[key] != b[key]:
            raise ValueError(f"sender and receiver differ in {what}: {a[key]!r} != {b[key]!r}; use the same checkpoint at both ends")
    if sender_tokenizer is not None and receiver_tokenizer is not None and sender_tokenizer is not receiver_tokenizer:
        if tokenizer_vocab_hash(sender_tokenizer) != tokenizer_vocab_hash(receiver_tokenizer):
            raise ValueError("sender and receiver tokenizers have different vocabularies; use the same tokenizer at both ends")
    if sender_model is not receiver_model:
        from ilcp.lm import forward_config_hash

        if (weights_digest(sender_model), forward_config_hash(sender_model)) != (
                weights_digest(receiver_model), forward_config_hash(receiver_model)):
            raise ValueError("sender and receiver models have different weights or forward configuration (their "
                             "LM fingerprints differ); use the same checkpoint at both ends")


# --------------------------------------------------------------------------------------------
# tokenizer


def encode_text(tokenizer, text: str, max_tokens: int | None = None, *, what: str = "the text") -> torch.Tensor:
    """Token IDs of rendered text without added special tokens, int64 [1, n].

    ``max_tokens`` (the model's positions, `text_limit`) bounds the text as ILCP bounds its
    contexts and questions (`ilcp.checks.text_input`: at most ``max_tokens x CHARS_PER_TOKEN``
    characters, valid Unicode), checked before the tokenizer runs; ValueError naming ``what``."""
    if tokenizer is None:
        raise ValueError("text needs a tokenizer; pass int64 [1, tokens] IDs instead")
    text_input(what, text, max_tokens)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor([list(ids)], dtype=torch.long)


def text_limit(model: nn.Module) -> int | None:
    """The token bound of `encode_text` for a model: its ``max_position_embeddings`` (None when
    the config names none, as `ilcp.lm.LM.max_positions`)."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(limit) if limit else None


def render_chat(tokenizer, messages, *, add_generation_prompt: bool, max_tokens: int | None = None) -> str:
    """Apply the tokenizer's chat template; thinking disabled for templates that read it.
    ``max_tokens``: the messages' texts together are bounded as `encode_text` bounds a text,
    before the template renders them."""
    if tokenizer is None:
        raise ValueError("chat messages need a tokenizer with a chat template; pass text or IDs instead")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass rendered text or int64 [1, tokens] IDs")
    _check_messages(messages, max_tokens)
    kwargs = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if add_generation_prompt:
        kwargs["enable_thinking"] = False
    return tokenizer.apply_chat_template(list(messages), **kwargs)


def _content_characters(content) -> int:
    if isinstance(content, str):
        return len(content)
    return sum(len(v) for part in content if isinstance(part, dict) for v in part.values() if isinstance(v, str))


def _check_messages(messages, max_tokens: int | None = None) -> None:
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"chat messages must be a list of dicts, got {type(messages).__name__}")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"each chat message must be a dict with 'role' and 'content', got {_short(m)}")
        # A list of content parts is the multimodal form some templates read; anything else would
        # fail inside the template's Jinja code with a message that names neither field.
        if not isinstance(m["role"], str) or not isinstance(m["content"], (str, list)):
            raise TypeError(f"a chat message's role must be a string and its content a string, got "
                            f"{_short(m)}")
    text_length("the text of the chat messages", sum(_content_characters(m["content"]) for m in messages), max_tokens)


def _short(value, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def check_ids(ids, vocab: int, what: str = "token IDs") -> torch.Tensor:
    """Validate int64 [1, n] IDs (n >= 1) within a vocabulary; returns them on the CPU."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype != torch.int64:
        raise ValueError(f"{what} must be int64, got {ids.dtype}")
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"{what} must be shaped [1, tokens] with at least one token, got {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"{what} must lie in [0, {vocab}), got values in [{int(ids.min())}, {int(ids.max())}]")
    return ids.detach().cpu()
