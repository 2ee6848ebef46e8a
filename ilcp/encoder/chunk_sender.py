"""A chunk writer that is the sender's own LM: the chunk read as its own sequence, then a memory token.

`SenderChunkWriter` has the writer interface of `ChunkWriter` (chunks of c token embeddings ->
one vector each), but the vector comes from the frozen LM itself: the LM reads the chunk's c
tokens followed by one memory token (positions 0..c, the chunk alone, so the vector depends on
its chunk only), and the memory token's last-layer state, mapped by a linear head, is the vector.
Low-rank adapters on every linear map of the LM's top ``layers`` decoder layers are trained with
the head (the LM's own weights never change); they act only while the writer runs (forward hooks
added for its forward and removed after it, as the slot memory's adapters), so the same LM
object reads the memory as the frozen receiver. As in `ChunkWriter`, the head starts at zero
and the chunk's first token embedding is added, so an untrained writer hands over that token.

Why the LM: the embedding MLP learns the vocabulary token by token (frequent tokens come back,
the long tail of open text does not); the LM's states already represent every token and its
context, and attention can carry a token into the memory state by a map shared across the
vocabulary. The LM's parameters, state dict and fingerprint are untouched.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .chunk import ChunkWriter
from .slots import LowRank, adapters_acting

__all__ = ["SenderChunkWriter", "decoder_layers"]


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
        rank: the adapters' rank.
        reading: tuned reading vectors, as `ChunkWriter`'s (0: none).
    """

    def __init__(self, model: nn.Module, chunk_tokens: int, memory_embedding: Tensor, *, layers: int = 4,
                 rank: int = 8, reading: int = 0):
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
        self.register_buffer("memory_embedding", memory_embedding.detach().float().clone())
        self.head = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        names = {id(m): n for n, m in model.named_modules()}
        self._adapted, self._keys = [], {}  # (LM module name, in, out); LM module name -> adapter key
        for i in range(len(stack) - layers, len(stack)):
            for name, module in stack[i].named_modules():
                if isinstance(module, nn.Linear):
                    full = names[id(module)]
                    self._adapted.append((full, module.in_features, module.out_features))
                    self._keys[full] = f"{i}.{name}".replace(".", "_")  # "22_self_attn_q_proj"
        self.adapters = nn.ModuleDict({self._keys[full]: LowRank(n_in, n_out, rank)
                                       for full, n_in, n_out in self._adapted})
        self.reading = nn.Parameter(torch.zeros(reading, hidden)) if reading else None

    def settings(self) -> dict:
        out = {"kind": "sender", "hidden_size": self.hidden_size, "chunk_tokens": self.chunk_tokens,
               "layers": self.layers, "rank": self.rank}
        if self.reading is not None:
            out["reading"] = int(self.reading.shape[0])
        return out

    with_reading = ChunkWriter.with_reading  # the reading vectors first, as the embedding writer's

    def forward(self, embeds: Tensor, lengths: Tensor | None = None) -> Tensor:
        """``embeds`` (N, c, H): the chunks' token embeddings; ``lengths`` (N,): each chunk's real
        tokens (default c; the rest is padding the memory token does not read) -> (N, H) float32."""
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
        with adapters_acting(model, self._adapted, self.adapters, "chunk writer", self._keys.__getitem__):
            out = model.base_model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions, use_cache=False)
        state = out.last_hidden_state[:, -1].float()
        return embeds[:, 0].float() + self.head(state)
