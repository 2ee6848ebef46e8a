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

__all__ = ["SenderChunkWriter", "adapter_key", "decoder_layers", "memory_token_id", "top_layer_modules"]


def memory_token_id(tokenizer) -> int:
    """The token whose input embedding is the memory token: end-of-text (else padding, else id 0)."""
    return next((t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None), 0)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a transformers causal LM (``model.model.layers`` for Llama and Qwen)."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layers found (expected base_model.layers)")
    return layers


def top_layer_modules(model: nn.Module, layers: int) -> list[tuple[str, int, int]]:
    """(LM module name, in, out) of every linear map in the LM's top `layers` decoder layers."""
    stack = decoder_layers(model)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= len(stack):
        raise ValueError(f"SenderChunkWriter: layers={layers!r}, but the LM has {len(stack)} decoder layers "
                         f"(1 to {len(stack)})")
    chosen = {id(m) for layer in stack[len(stack) - layers:] for m in layer.modules()}
    return [(name, m.in_features, m.out_features) for name, m in model.named_modules()
            if id(m) in chosen and isinstance(m, nn.Linear)]


def adapter_key(name: str) -> str:
    """An adapted LM module's key among the writer's adapters: its layer index and its path in the
    layer ("model.layers.22.self_attn.q_proj" -> "22_self_attn_q_proj")."""
    parts = name.split(".")
    first = next((i for i, part in enumerate(parts) if part.isdigit()), 0)
    return "_".join(parts[first:])


class SenderChunkWriter(nn.Module):
    """Chunks of c token embeddings -> one memory vector each, written by the LM with adapters.

    Built for an LM with `for_model`; built from recorded settings (an export's config.json) with
    the constructor and then bound to the LM it was trained for with `bind` (the LM is not part of
    the writer's weights).

    Args:
        hidden_size: the LM's width.
        chunk_tokens: c, tokens per chunk.
        modules: ((LM module name, in, out), ...): the linear maps the adapters adapt, those of the
            top ``layers`` decoder layers (`top_layer_modules`).
        layers: how many top decoder layers that is (>= 1).
        rank: the adapters' rank.
        reading: tuned reading vectors, as `ChunkWriter`'s (0: none).
    """

    def __init__(self, hidden_size: int, chunk_tokens: int, modules, *, layers: int, rank: int, reading: int = 0):
        super().__init__()
        for name, value, low in (("hidden_size", hidden_size, 1), ("chunk_tokens", chunk_tokens, 1),
                                 ("layers", layers, 1), ("rank", rank, 1), ("reading", reading, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"SenderChunkWriter: {name} must be an integer >= {low}, got {value!r}")
        self._adapted = tuple((str(name), int(n_in), int(n_out)) for name, n_in, n_out in modules)
        if not self._adapted:
            raise ValueError("SenderChunkWriter: no LM modules to adapt")
        keys = [adapter_key(name) for name, _, _ in self._adapted]
        if len(set(keys)) != len(keys):
            raise ValueError("SenderChunkWriter: two adapted LM modules share a layer index and path")
        self._model: tuple[nn.Module, ...] = ()  # the bound LM, in a tuple: not a submodule, not in the state dict
        self.hidden_size, self.chunk_tokens, self.layers, self.rank = hidden_size, chunk_tokens, layers, rank
        self.register_buffer("memory_embedding", torch.zeros(hidden_size))  # the memory token's input embedding
        self.head = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.adapters = nn.ModuleDict({key: LowRank(n_in, n_out, rank)
                                       for key, (_, n_in, n_out) in zip(keys, self._adapted)})
        self.reading = nn.Parameter(torch.zeros(reading, hidden_size)) if reading else None

    @classmethod
    def for_model(cls, model: nn.Module, chunk_tokens: int, memory_embedding: Tensor, *, layers: int = 4,
                  rank: int = 8, reading: int = 0) -> SenderChunkWriter:
        """A new writer bound to `model` (the frozen LM, also the receiver), adapters on its top
        `layers` decoder layers, the memory token's input embedding `memory_embedding` (H,) (a
        token's row, e.g. the end-of-text token's)."""
        hidden = int(model.get_input_embeddings().weight.shape[1])
        if memory_embedding.shape != (hidden,):
            raise ValueError(f"SenderChunkWriter: memory_embedding must be ({hidden},), got "
                             f"{tuple(memory_embedding.shape)}")
        writer = cls(hidden, chunk_tokens, top_layer_modules(model, layers), layers=layers, rank=rank, reading=reading)
        with torch.no_grad():
            writer.memory_embedding.copy_(memory_embedding.detach().float())
        writer.bind(model)
        return writer.to(memory_embedding.device)

    @property
    def adapted_modules(self) -> tuple[tuple[str, int, int], ...]:
        """((LM module name, in, out), ...) the adapters adapt."""
        return self._adapted

    def bind(self, model: nn.Module) -> None:
        """Write with `model` from now on: the LM these adapters were trained for (same width, the
        adapted modules at these sizes in its top ``layers`` decoder layers); ValueError otherwise."""
        try:
            stack = decoder_layers(model)
        except ValueError:
            raise ValueError(f"this chunk writer is the LM itself (writer: sender): it needs the whole LM, and "
                             f"{type(model).__name__} has no decoder layers (an LM of its embedding table alone "
                             "cannot send with it)") from None
        hidden = int(model.get_input_embeddings().weight.shape[1])
        if hidden != self.hidden_size:
            raise ValueError(f"this chunk writer was trained for an LM of width {self.hidden_size}, not {hidden}")
        if self.layers > len(stack) or list(top_layer_modules(model, self.layers)) != list(self._adapted):
            raise ValueError(f"this chunk writer's adapters do not fit this LM's top {self.layers} decoder layers")
        self._model = (model,)

    @property
    def model(self) -> nn.Module:
        if not self._model:
            raise ValueError("this chunk writer is the LM itself: bind it to its LM first (writer.bind(model); "
                             "ILCPHandoff does so)")
        return self._model[0]

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
        model = self.model
        n, c, _ = embeds.shape
        dtype = model.get_input_embeddings().weight.dtype
        memory = self.memory_embedding.to(dtype).expand(n, 1, -1)
        inputs = torch.cat([embeds.to(dtype), memory], dim=1)
        mask = torch.ones(n, c + 1, dtype=torch.long, device=embeds.device)
        if lengths is not None:
            mask[:, :c] = (torch.arange(c, device=embeds.device)[None, :] < lengths.to(embeds.device)[:, None]).long()
        positions = torch.arange(c + 1, device=embeds.device).expand(n, -1)
        with adapters_acting(model, self._adapted, self.adapters, "chunk writer", adapter_key):
            out = model.base_model(inputs_embeds=inputs, attention_mask=mask, position_ids=positions, use_cache=False)
        state = out.last_hidden_state[:, -1].float()
        return embeds[:, 0].float() + self.head(state)
