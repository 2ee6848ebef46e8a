"""Memory kinds: how an `ILCPEncoder` turns the sender's token states into the latents it sends.

Each kind is one frozen settings dataclass registered once under its name. The kind owns its
entries of config.json's ``pooling`` object (reading, checking, writing them) and builds its
pooler; the export schema (`ilcp.encoder.spec.EncoderSpec`) finds a config's kind here.

- ``pooled``: one latent per context, the masked mean of its token states (``pooling.kind``
  "mean") or the learned queries of an `AttentionPooler` ("attention", ``pooling.pool_queries``,
  the training config's ``compressor.pool_queries``).
- ``chunked``: one latent per chunk of C consecutive tokens (``pooling.chunk_tokens`` = C), each
  chunk pooled as above: a context of S tokens sends ceil(S / C) latents.
- ``codec``: chunks of C tokens whose states the VAE reads side by side (``pooling.kind``
  "concat", `ConcatPooler`); with K = C memory vectors per latent, read in the prompt as tokens.
- ``slots`` (`ilcp.encoder.slots`): learned tokens the sender's LM reads after the context, one
  latent per slot, their number growing with the context.

The kinds are registered in `ilcp.names.MEMORY_KINDS` (which also names the ``pooling.kind``
values each reads, so that a config is checked before torch loads); this module imports each
kind's class there when a kind is first looked up. A new kind (a long-context memory, say) is one
new module:

    @dataclass(frozen=True)
    class RecurrentMemory(MemoryKind):
        name: ClassVar[str] = "recurrent"
        pooling_kinds: ClassVar[tuple[str, ...]] = MEMORY_KINDS["recurrent"].pooling_kinds
        state_slots: int = 4
        ...  # claims, from_pooling, pooling_entries, from_encoder, pooler (and encoder, for a new module)

and one entry in `ilcp.names.MEMORY_KINDS`, ``"recurrent": RegisteredMemoryKind("ilcp.recurrent:RecurrentMemory",
("recurrent",))``. `register_memory_kind` adds a kind at run time (one a config cannot name).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from .compressor import BetaVAE
from .model import ILCPEncoder
from ..names import MEMORY_KINDS, resolve
from .pooling import AttentionPooler, ConcatPooler, Pooler
from .projector import GatedLatentToMemoryProjector

__all__ = ["MemoryKind", "register_memory_kind", "memory_kinds", "pooling_kinds", "memory_kind_for",
           "memory_kind_of", "config_value"]


# The largest count any memory kind's setting may hold (queries, tokens per chunk or slot, slots,
# adapter rank): far above what any recipe uses, far below what would exhaust memory when built.
MAX_COUNT = 1 << 16


def config_value(config: dict, dotted: str, kind, *, minimum=None, maximum=None, required: bool = True,
                 default=None):
    """The entry ``dotted`` ("pooling.pool_queries") of a config.json object, of type `kind` (int,
    float for any finite number, str, dict, list; a bool is never a number), at least `minimum`
    and at most `maximum`.

    Raises:
        ValueError: one line naming the entry; a missing entry only when `required` (else `default`).
    """
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if not required:
                return default
            raise ValueError(f"missing {dotted!r}")
        node = node[part]
    if kind in (int, float):
        ok = isinstance(node, (int, float) if kind is float else int) and not isinstance(node, bool)
    else:
        ok = isinstance(node, kind)
    if not ok or (isinstance(node, float) and not math.isfinite(node)):
        raise ValueError(f"{dotted!r} must be {'a number' if kind is float else kind.__name__}, got {node!r}")
    if minimum is not None and node < minimum:
        raise ValueError(f"{dotted!r} must be >= {minimum}, got {node!r}")
    if maximum is not None and node > maximum:
        raise ValueError(f"{dotted!r} must be <= {maximum:,}, got {node!r}")
    return node


@dataclass(frozen=True)
class MemoryKind:
    """The settings of one memory kind; subclasses are frozen dataclasses, registered once.

    Class attributes: ``name`` (the registry's key) and ``pooling_kinds`` (the values of
    ``pooling.kind`` the kind reads).
    """

    name: ClassVar[str]
    pooling_kinds: ClassVar[tuple[str, ...]]

    @property
    def chunk_tokens(self) -> int:
        """C > 0: one latent per chunk of C tokens; 0: one latent per context."""
        return 0

    @classmethod
    def claims(cls, pooling: dict) -> bool:
        """Whether config.json's ``pooling`` object describes this kind (checked or not)."""
        raise NotImplementedError

    @classmethod
    def from_pooling(cls, pooling: dict) -> MemoryKind:
        """The settings a claimed ``pooling`` object holds. Raises ValueError naming the entry."""
        raise NotImplementedError

    def pooling_entries(self) -> dict:
        """This kind's entries of config.json's ``pooling`` object ("kind" and its own settings)."""
        raise NotImplementedError

    @classmethod
    def from_encoder(cls, encoder: ILCPEncoder) -> MemoryKind | None:
        """The settings of an encoder of this kind; None when the encoder is of another kind."""
        raise NotImplementedError

    def pooler(self, state_dim: int, hidden_size: int | None = None) -> Pooler | None:
        """An untrained pooler for token states of width `state_dim` (None: the masked mean);
        `hidden_size` is the LM's (for a kind whose parts are LM inputs)."""
        raise NotImplementedError

    def encoder(self, vae: BetaVAE, projector: GatedLatentToMemoryProjector | None, pooler: Pooler | None,
                **receiver) -> ILCPEncoder:
        """The encoder module of this kind around its parts; `receiver` are the `ILCPEncoder`
        receiver settings (placement, format_prompt, vocabulary_snap, ...)."""
        return ILCPEncoder(vae, projector, pooler, chunk_tokens=self.chunk_tokens, **receiver)


_KINDS: dict[str, type[MemoryKind]] = {}  # the kinds register_memory_kind added at run time


def _registered(name: str) -> type[MemoryKind]:
    """The settings class `ilcp.names.MEMORY_KINDS` registers under `name`, imported, checked."""
    entry = MEMORY_KINDS[name]
    cls = resolve(entry.target)
    if not (isinstance(cls, type) and issubclass(cls, MemoryKind)) or cls.name != name:
        raise ValueError(f"ilcp.names.MEMORY_KINDS[{name!r}] names {cls!r}, not a MemoryKind named {name!r}")
    if tuple(cls.pooling_kinds) != tuple(entry.pooling_kinds):
        raise ValueError(f"{cls.__name__} reads pooling kinds {cls.pooling_kinds}, but ilcp.names.MEMORY_KINDS "
                         f"registers {entry.pooling_kinds}")
    return cls


def register_memory_kind(cls: type[MemoryKind]) -> type[MemoryKind]:
    """Class decorator: add a memory kind under ``cls.name`` (once) at run time; the kinds a
    config can name are registered in `ilcp.names.MEMORY_KINDS`."""
    if not (isinstance(cls, type) and issubclass(cls, MemoryKind)):
        raise ValueError(f"a memory kind subclasses MemoryKind, got {cls!r}")
    taken = memory_kinds().get(cls.name)
    if taken is not None and taken is not cls:
        raise ValueError(f"a memory kind named {cls.name!r} is already registered ({taken.__name__})")
    _KINDS[cls.name] = cls
    return cls


def memory_kinds() -> dict[str, type[MemoryKind]]:
    """Name -> settings class of every kind: those of `ilcp.names.MEMORY_KINDS` in its order, then
    those registered at run time."""
    kinds = {name: _registered(name) for name in MEMORY_KINDS}
    return {**kinds, **{name: cls for name, cls in _KINDS.items() if name not in kinds}}


def pooling_kinds() -> tuple[str, ...]:
    """Every ``pooling.kind`` value a kind reads, in the order of `memory_kinds`."""
    return tuple(dict.fromkeys(p for cls in memory_kinds().values() for p in cls.pooling_kinds))


def memory_kind_for(pooling: dict) -> MemoryKind:
    """The settings config.json's ``pooling`` object describes, checked.

    Raises:
        ValueError: no registered kind reads it, or an entry is missing or wrong (one line).
    """
    for cls in memory_kinds().values():
        if cls.claims(pooling):
            return cls.from_pooling(pooling)
    raise ValueError(f"unknown pooling kind {pooling.get('kind')!r} in config.json (this package reads "
                     f"{', '.join(pooling_kinds())})")


def memory_kind_of(encoder: ILCPEncoder) -> MemoryKind:
    """The settings of an encoder's kind."""
    for cls in memory_kinds().values():
        settings = cls.from_encoder(encoder)
        if settings is not None:
            return settings
    raise ValueError(f"no registered memory kind builds an encoder that pools with {encoder.pooling!r} "
                     f"and chunks of {encoder.chunk_tokens} tokens")


# --------------------------------------------------------------------------------------------
# the built-in kinds


@dataclass(frozen=True)
class PooledMemory(MemoryKind):
    """One latent per context: the masked mean of its token states, or `pool_queries` learned
    attention queries (the VAE then reads pool_queries x D floats)."""

    name: ClassVar[str] = "pooled"
    pooling_kinds: ClassVar[tuple[str, ...]] = MEMORY_KINDS["pooled"].pooling_kinds

    pooling: str = "mean"
    pool_queries: int = 0  # attention only

    def __post_init__(self):
        if self.pooling not in self.pooling_kinds:
            raise ValueError(f"'pooling.kind' must be one of {list(self.pooling_kinds)} for {self.name} memory, "
                             f"got {self.pooling!r}")
        if self.pooling == "attention" and not self.pool_queries >= 1:
            raise ValueError(f"'pooling.pool_queries' must be >= 1, got {self.pool_queries!r}")

    @classmethod
    def claims(cls, pooling: dict) -> bool:
        return pooling.get("kind", "mean") in cls.pooling_kinds and pooling.get("chunk_tokens") in (None, 0)

    @classmethod
    def _pooled_settings(cls, pooling: dict) -> dict:
        kind = pooling.get("kind", "mean")
        if kind != "attention":
            return {"pooling": kind, "pool_queries": 0}
        entry = "pool_queries"
        # legacy read path: exports written before this entry took the training config's name
        # (compressor.pool_queries) call it 'num_queries'; their config.json is read as written
        if "num_queries" in pooling:
            if "pool_queries" in pooling:
                raise ValueError("'pooling' names its queries twice: 'pool_queries' and the older 'num_queries'")
            entry = "num_queries"
        return {"pooling": kind, "pool_queries": config_value({"pooling": pooling}, f"pooling.{entry}", int, minimum=1,
                                                              maximum=MAX_COUNT)}

    @classmethod
    def from_pooling(cls, pooling: dict) -> PooledMemory:
        config_value({"pooling": pooling}, "pooling.chunk_tokens", int, minimum=0, maximum=MAX_COUNT, required=False)
        return cls(**cls._pooled_settings(pooling))

    def pooling_entries(self) -> dict:
        return {"kind": self.pooling, **({"pool_queries": self.pool_queries} if self.pooling == "attention" else {})}

    @classmethod
    def from_encoder(cls, encoder: ILCPEncoder) -> PooledMemory | None:
        if encoder.pooling not in cls.pooling_kinds or encoder.chunked:
            return None
        return cls(encoder.pooling, encoder.pooler.num_queries if encoder.pooling == "attention" else 0)

    def pooler(self, state_dim: int, hidden_size: int | None = None) -> AttentionPooler | None:
        return AttentionPooler(state_dim, self.pool_queries) if self.pooling == "attention" else None


@dataclass(frozen=True)
class ChunkedMemory(PooledMemory):
    """One latent per chunk of `chunk_tokens` consecutive tokens, each pooled as `PooledMemory`
    pools a context, so the payload grows with the context."""

    name: ClassVar[str] = "chunked"
    pooling_kinds: ClassVar[tuple[str, ...]] = MEMORY_KINDS["chunked"].pooling_kinds

    chunk_tokens: int = 1  # C, tokens per chunk

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"'pooling.chunk_tokens' must be >= 1, got {self.chunk_tokens!r}")

    @classmethod
    def claims(cls, pooling: dict) -> bool:
        return pooling.get("kind", "mean") in cls.pooling_kinds and pooling.get("chunk_tokens") not in (None, 0)

    @classmethod
    def from_pooling(cls, pooling: dict) -> ChunkedMemory:
        chunks = config_value({"pooling": pooling}, "pooling.chunk_tokens", int, minimum=0, maximum=MAX_COUNT)
        return cls(**cls._pooled_settings(pooling), chunk_tokens=chunks)

    def pooling_entries(self) -> dict:
        return {**super().pooling_entries(), "chunk_tokens": self.chunk_tokens}

    @classmethod
    def from_encoder(cls, encoder: ILCPEncoder) -> ChunkedMemory | None:
        if encoder.pooling not in cls.pooling_kinds or not encoder.chunked:
            return None
        return cls(encoder.pooling, encoder.pooler.num_queries if encoder.pooling == "attention" else 0,
                   chunk_tokens=encoder.chunk_tokens)


@dataclass(frozen=True)
class CodecMemory(MemoryKind):
    """Chunks of `chunk_tokens` tokens whose states the VAE reads side by side (a parameter-free
    `ConcatPooler`), so a latent keeps which token stood where; trained with K = C and the token
    loss, memory vector j reads as the chunk's j-th token."""

    name: ClassVar[str] = "codec"
    pooling_kinds: ClassVar[tuple[str, ...]] = MEMORY_KINDS["codec"].pooling_kinds

    chunk_tokens: int = 1  # C, tokens per chunk

    def __post_init__(self):
        if isinstance(self.chunk_tokens, bool) or not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"'pooling.chunk_tokens' must be >= 1, got {self.chunk_tokens!r}")

    @classmethod
    def claims(cls, pooling: dict) -> bool:
        return pooling.get("kind") in cls.pooling_kinds

    @classmethod
    def from_pooling(cls, pooling: dict) -> CodecMemory:
        return cls(config_value({"pooling": pooling}, "pooling.chunk_tokens", int, minimum=1, maximum=MAX_COUNT))

    def pooling_entries(self) -> dict:
        return {"kind": "concat", "chunk_tokens": self.chunk_tokens}

    @classmethod
    def from_encoder(cls, encoder: ILCPEncoder) -> CodecMemory | None:
        return cls(encoder.chunk_tokens) if encoder.pooling == "concat" else None

    def pooler(self, state_dim: int, hidden_size: int | None = None) -> ConcatPooler:
        return ConcatPooler(state_dim, self.chunk_tokens)
