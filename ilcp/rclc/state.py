"""`SenderState`: the exact input rows and KV cache of one unpadded sender sequence."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ilcp import compat
from ilcp.rclc import hf


def _check_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def rows_match_ids(rows: torch.Tensor, token_ids: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether the rows with a known token ID reproduce that ID's input embedding.

    The one check behind `SenderState` validation, mixed messages in `transfer` and snapshot
    loading. Rows whose ID is -1 (continuous) are not compared.

    Args:
        rows: [T, hidden] input rows.
        token_ids: int64 [T] aligned IDs, -1 for continuous rows (any device).
        embed: maps int64 [n] IDs to the expected rows [n, hidden] (the model's embedding
            module, or the table lookup a receiver will use to rebuild the rows).
    Returns:
        True when every known row matches within rtol 1e-3, atol 1e-5 (also when none is known).
    """
    known = (token_ids >= 0).nonzero().flatten()
    if known.numel() == 0:
        return True
    expected = embed(token_ids[known])
    return torch.allclose(rows[known.to(rows.device)].float(), expected.to(rows.device).float(), rtol=1e-3, atol=1e-5)


@dataclass(eq=False)
class SenderState:
    """What a sender can hand off: the input rows that built its cache.

    Attributes:
        model: the sender's causal LM, in eval mode (shared, read-only).
        past_key_values: the transformers Cache built from exactly ``input_embeds`` (one unpadded
            sequence of ``positions`` cached positions).
        input_embeds: [positions, hidden] the exact input embeddings (not hidden states), on the
            model's device and dtype.
        tokenizer: the sender's tokenizer, or None (string requests then cannot be tokenized).
        latent_steps: the final ``latent_steps`` rows are a continuous latent tail.
        token_ids: optional int64 [positions], -1 where a row is continuous (no token ID).
        inherited_positions: leading rows received from earlier agents (the carried prefix).

    Raises:
        TypeError / ValueError (at construction): wrong device, dtype or shape; model in training
        mode; non-finite rows; cache length, token IDs and rows that disagree; a latent tail that
        overlaps the inherited prefix or has token IDs.
    """

    model: nn.Module
    past_key_values: Any
    input_embeds: torch.Tensor
    tokenizer: Any = None
    latent_steps: int = 0
    token_ids: torch.Tensor | None = None
    inherited_positions: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def positions(self) -> int:
        """Number of rows (= cached positions)."""
        return int(self.input_embeds.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.input_embeds.shape[1])

    def validate(self) -> None:
        """Check every invariant listed in the class docstring; raises on the first violation."""
        model = self.model
        if not isinstance(model, nn.Module) or not hasattr(model, "get_input_embeddings"):
            raise TypeError(f"model must be a Hugging Face model with get_input_embeddings(), got {type(model).__name__}")
        if model.training:
            raise ValueError("the sender model is in training mode; call model.eval() first")
        weight = hf.embedding_weight(model)
        rows = self.input_embeds
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"input_embeds must be a torch.Tensor, got {type(rows).__name__}")
        if rows.dim() != 2 or rows.shape[0] < 1:
            raise ValueError(f"input_embeds must be [positions, hidden] with at least one position, got {tuple(rows.shape)}")
        if rows.shape[1] != weight.shape[1]:
            raise ValueError(f"input_embeds width {rows.shape[1]} != the model's hidden size {weight.shape[1]}")
        if rows.device != weight.device:
            raise ValueError(f"input_embeds are on {rows.device}, the model on {weight.device}")
        if rows.dtype != weight.dtype:
            raise ValueError(f"input_embeds are {rows.dtype}, the model is {weight.dtype}")
        if not bool(torch.isfinite(rows).all()):
            raise ValueError("input_embeds contain non-finite values")
        n = rows.shape[0]
        if self.past_key_values is None:
            raise ValueError("past_key_values is required: the cache built from input_embeds")
        cached = compat.cache_length(self.past_key_values)
        if cached != n:
            raise ValueError(f"the cache holds {cached} positions but input_embeds has {n} rows")
        latent = _check_count(self.latent_steps, "latent_steps")
        inherited = _check_count(self.inherited_positions, "inherited_positions")
        if latent > n:
            raise ValueError(f"latent_steps={latent} exceeds the {n} rows")
        if inherited > n:
            raise ValueError(f"inherited_positions={inherited} exceeds the {n} rows")
        if inherited + latent > n:
            raise ValueError(f"the inherited prefix ({inherited}) overlaps the latent tail ({latent}) in {n} rows")
        ids = self.token_ids
        if ids is None:
            return
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise ValueError("token_ids must be an int64 vector [positions]")
        if ids.shape[0] != n:
            raise ValueError(f"token_ids has {ids.shape[0]} entries for {n} rows")
        if bool((ids < -1).any()) or bool((ids >= weight.shape[0]).any()):
            raise ValueError(f"token_ids must be -1 (continuous) or in [0, {weight.shape[0]})")
        if latent and bool((ids[n - latent:] != -1).any()):
            raise ValueError("the latent tail must have token_ids -1")
        if not rows_match_ids(rows, ids, lambda known: hf.embed_ids(model, known)):
            raise ValueError("input_embeds rows do not match the embeddings of their token_ids")

    def replace(self, **changes: Any) -> "SenderState":
        """A new, validated state with some fields changed (tensors are shared, not copied)."""
        return dataclasses.replace(self, **changes)

    def private_copy(self) -> "SenderState":
        """A state whose rows, IDs and cache share no storage with this one (model and tokenizer shared)."""
        return SenderState(
            model=self.model,
            past_key_values=compat.clone_cache(self.past_key_values),
            input_embeds=self.input_embeds.clone(),
            tokenizer=self.tokenizer,
            latent_steps=self.latent_steps,
            token_ids=None if self.token_ids is None else self.token_ids.clone(),
            inherited_positions=self.inherited_positions,
        )

    def __repr__(self) -> str:
        return (
            f"SenderState(model={type(self.model).__name__}, positions={self.positions}, "
            f"hidden={self.hidden_size}, latent_steps={self.latent_steps}, "
            f"inherited_positions={self.inherited_positions}, "
            f"token_ids={'yes' if self.token_ids is not None else 'no'})"
        )
