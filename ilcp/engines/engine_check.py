"""Whether a vLLM engine serves an LM: its model configuration, what it runs, and the check that
its hidden size, vocabulary, tokenizer and input embeddings are the LM's (`ilcp.engines.vllm`'s
receivers and senders run it when they are built).
"""

from __future__ import annotations

import functools
import hashlib
import json

import torch

from ..lm import LM

__all__ = ["check_engine_serves", "model_config", "runner_type"]

_EMBED_ROWS_PER_STEP = 4096


def model_config(llm):
    """The engine's vLLM model configuration, or ValueError for anything but a ``vllm.LLM``."""
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    if config is None:
        raise ValueError(f"llm must be a vllm.LLM engine, got {type(llm).__name__}")
    return config


def _embedding_digest(embed, rows: int, dtype: torch.dtype, device) -> str:
    h = hashlib.sha256()
    with torch.inference_mode():
        for start in range(0, rows, _EMBED_ROWS_PER_STEP):
            ids = torch.arange(start, min(rows, start + _EMBED_ROWS_PER_STEP), device=device)
            block = embed(ids).to(device="cpu", dtype=dtype).contiguous()
            h.update(block.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _engine_embedding_digest(model, rows: int, dtype: str) -> str:
    """Runs inside the engine's worker: the digest of its input embeddings of ids 0..rows-1."""
    embed = getattr(model, "embed_input_ids", None) or getattr(model, "get_input_embeddings", None)
    if embed is None:
        raise ValueError(f"the served model {type(model).__name__} has no input-embedding method")
    device = next(model.parameters()).device
    return _embedding_digest(embed, rows, getattr(torch, dtype), device)


# Tokens vLLM registers on its own tokenizer (outside the model's vocabulary): with prompt
# embeddings on, a second engine on the same directory in one process finds "<prompt_embeds>"
# added as a special token.
_VLLM_ADDED_TOKENS = frozenset({"<prompt_embeds>"})


def _served_vocab_hash(tokenizer, rows: int) -> str:
    """A hash of the vocabulary and special tokens (as `ilcp.lm.vocab_hash` reads them) without the
    tokens vLLM adds past the model's ``rows`` embeddings."""
    vocab = tokenizer.get_vocab()
    added = {t for t in _VLLM_ADDED_TOKENS if vocab.get(t, -1) >= rows}
    items = sorted(((k, v) for k, v in vocab.items() if k not in added), key=lambda kv: kv[1])
    special = sorted(t for t in map(str, tokenizer.all_special_tokens) if t not in added)
    payload = json.dumps({"vocab": items, "special": special}, ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def check_engine_serves(lm: LM, llm, config, check_weights: bool) -> None:
    """The engine's hidden size, vocabulary and input embeddings are those of ``lm``."""
    hidden = int(config.get_hidden_size())
    if hidden != lm.hidden_size:
        raise ValueError(
            f"the vLLM engine serves a model of hidden size {hidden}, but the handoff's LM ({lm.spec!r}) has "
            f"hidden size {lm.hidden_size}: start the engine on the handoff's LM (model_directory(handoff.lm))"
        )
    rows = int(lm.model.get_input_embeddings().weight.shape[0])
    vocab = int(config.get_vocab_size())
    if vocab != rows:
        raise ValueError(f"the vLLM engine's vocabulary has {vocab} ids, the handoff's LM has {rows}: it serves "
                         "another model")
    tokenizer = llm.get_tokenizer() if not getattr(config, "skip_tokenizer_init", False) else None
    if tokenizer is not None and _served_vocab_hash(tokenizer, rows) != _served_vocab_hash(lm.tokenizer, rows):
        raise ValueError("the vLLM engine's tokenizer differs from the handoff's LM's: it serves another model")
    if not check_weights:
        return
    dtype = config.dtype
    hf_dtype = lm.dtype
    if torch.finfo(hf_dtype).bits < torch.finfo(dtype).bits:
        dtype = hf_dtype
    name = str(dtype).removeprefix("torch.")
    try:
        served = llm.apply_model(functools.partial(_engine_embedding_digest, rows=rows, dtype=name))
    except Exception as e:
        raise RuntimeError(
            f"could not read the vLLM engine's input embeddings to check that it serves the handoff's LM ({e}); "
            "a multi-process engine needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 for that, or pass check_weights=False"
        ) from e
    expected = _embedding_digest(lm.model.get_input_embeddings(), rows, dtype, lm.device)
    if any(d != expected for d in served):
        raise ValueError(
            f"the vLLM engine's input embeddings differ from those of the handoff's LM ({lm.spec!r}, compared "
            f"in {name}): the engine serves other weights; start it on model_directory(handoff.lm)"
        )


def runner_type(config) -> str:
    """What the engine runs: "generate" or "pooling"."""
    return str(getattr(config, "runner_type", "generate"))
