"""A chunk writer that is the sender's own LM: the chunk read as its own sequence, then a memory token.

`SenderChunkWriter` has the writer interface of `ChunkWriter` (chunks of c token embeddings ->
one vector each), but the vector comes from the frozen LM itself: the LM reads the chunk's c
tokens followed by one memory token (positions 0..c, the chunk alone, so the vector depends on
its chunk only), and the memory token's last-layer state, mapped by a linear head, is the vector.
Low-rank adapters on every linear map of the LM's top ``layers`` decoder layers are trained with
the head (the LM's own weights never change); they act only while the writer runs, so the same
LM object reads the memory as the frozen receiver. As in `ChunkWriter`, the head starts at zero
and the chunk's first token embedding is added, so an untrained writer hands over that token.

Why the LM: the embedding MLP learns the vocabulary token by token (frequent tokens come back,
the long tail of open text does not); the LM's states already represent every token and its
context, and attention can carry a token into the memory state by a map shared across the
vocabulary. The adapters are installed as forward hooks, so the LM's parameters, state dict and
fingerprint are untouched; `close` removes them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .chunk import ChunkWriter

__all__ = ["SenderChunkWriter"]


class _LowRank(nn.Module):
    """x -> B(A(x)) * scale, B starting at zero (the adapter adds nothing until trained)."""

    def __init__(self, n_in: int, n_out: int, rank: int, alpha: float):
        super().__init__()
        self.a = nn.Parameter(torch.randn(rank, n_in) / math.sqrt(n_in))
        self.b = nn.Parameter(torch.zeros(n_out, rank))
        self.scale = alpha / rank

    def forward(self, x: Tensor) -> Tensor:
        return (x.float() @ self.a.T) @ self.b.T * self.scale


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.model.layers`` for Llama and Qwen)."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected base_model.layers)")
    return layers


class SenderChunkWriter(nn.Module):
    """Chunks of c token embeddings -> one memory vector each, written by the LM with adapters.

    Args:
        model: the frozen transformers causal LM (also the receiver; not registered here, so the
            writer's state dict holds only what it trains).
        chunk_tokens: c, tokens per chunk.
        memory_embedding: (H,) the memory token's input embedding (fixed), e.g. a token's row.
        layers: the top decoder layers whose linear maps get adapters (>= 1).
        rank, alpha: the adapters' rank and scale (alpha / rank).
        reading: tuned reading vectors, as `ChunkWriter`'s (0: none).
    """

    def __init__(self, model: nn.Module, chunk_tokens: int, memory_embedding: Tensor, *, layers: int = 4,
                 rank: int = 8, alpha: float = 16.0, reading: int = 0):
        super().__init__()
        stack = decoder_layers(model)
        for name, value, low in (("chunk_tokens", chunk_tokens, 1), ("layers", layers, 1), ("rank", rank, 1),
                                 ("reading", reading, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"SenderChunkWriter: {name} must be an integer >= {low}, got {value!r}")
        if layers > len(stack):
            raise ValueError(f"SenderChunkWriter: layers={layers}, but the LM has {len(stack)} decoder layers")
        hidden = int(model.get_input_embeddings().weight.shape[1])
        if memory_embedding.shape != (hidden,):
            raise ValueError(f"SenderChunkWriter: memory_embedding must be ({hidden},), got "
                             f"{tuple(memory_embedding.shape)}")
        self._model = (model,)  # a tuple keeps the LM out of this module's parameters and state dict
        self.hidden_size, self.chunk_tokens, self.layers, self.rank = hidden, chunk_tokens, layers, rank
        self.alpha = float(alpha)
        self.register_buffer("memory_embedding", memory_embedding.detach().float().clone())
        self.head = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.adapters = nn.ModuleDict()
        self._hooks = []
        self._active = False
        first = len(stack) - layers
        for i in range(first, len(stack)):
            for name, module in stack[i].named_modules():
                if isinstance(module, nn.Linear):
                    key = f"{i}.{name}".replace(".", "_")
                    self.adapters[key] = _LowRank(module.in_features, module.out_features, rank, self.alpha)
                    self._hooks.append(module.register_forward_hook(self._hook(key)))
        self.reading = nn.Parameter(torch.zeros(reading, hidden)) if reading else None

    def _hook(self, key: str):
        def add_adapter(module, inputs, output):
            if not self._active:
                return output
            return output + self.adapters[key](inputs[0]).to(output.dtype)
        return add_adapter

    def close(self) -> None:
        """Remove the adapters' hooks from the LM (the writer no longer writes)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def settings(self) -> dict:
        out = {"kind": "sender", "hidden_size": self.hidden_size, "chunk_tokens": self.chunk_tokens,
               "layers": self.layers, "rank": self.rank, "alpha": self.alpha}
        if self.reading is not None:
            out["reading"] = int(self.reading.shape[0])
        return out

    with_reading = ChunkWriter.with_reading  # the reading vectors first, as the embedding writer's

    def forward(self, embeds: Tensor, lengths: Tensor | None = None) -> Tensor:
        """``embeds`` (N, c, H): the chunks' token embeddings; ``lengths`` (N,): each chunk's real
        tokens (default c; the rest is padding the memory token does not read) -> (N, H) float32."""
        if not self._hooks:
            raise ValueError("SenderChunkWriter: closed (its adapters were removed from the LM)")
        if embeds.dim() != 3 or embeds.shape[1:] != (self.chunk_tokens, self.hidden_size):
            raise ValueError(f"SenderChunkWriter expects chunks of shape (N, {self.chunk_tokens}, "
                             f"{self.hidden_size}), got {tuple(embeds.shape)}")
        model = self._model[0]
        n, c, _ = embeds.shape
        dtype = model.get_input_embeddings().weight.dtype
        memory = self.memory_embedding.to(dtype).expand(n, 1, -1)
        inputs = torch.cat([embeds.to(dtype), memory], dim=1)
        mask = torch.ones(n, c + 1, dtype=torch.long, device=embeds.device)
        if lengths is not None:
            mask[:, :c] = (torch.arange(c, device=embeds.device)[None, :] < lengths.to(embeds.device)[:, None]).long()
        positions = torch.arange(c + 1, device=embeds.device).expand(n, -1)
        self._active = True
        try:
            out = model.base_model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions, use_cache=False)
        finally:
            self._active = False
        state = out.last_hidden_state[:, -1].float()
        return embeds[:, 0].float() + self.head(state)
