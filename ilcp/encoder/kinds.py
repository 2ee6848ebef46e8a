"""Memory kinds: how an `ILCPEncoder` turns the sender's token states into the latents it sends.

A kind is one frozen dataclass whose fields are the settings of its memory, declared once
(`ilcp.settings.setting`: type, default, help, bounds). The same object is the training
config's ``compressor.memory`` (``compressor.memory.kind=attention``,
``compressor.memory.pool_queries=4``), config.json's ``pooling`` object (its ``kind`` and its
own entries, beside the spec's ``layers`` and ``max_length``) and what `EncoderSpec` builds from.
The kind answers what training and sending ask of a memory: whether it reads cached token states
or runs the sender's LM itself, how its encoder starts (fit in stage 1, or `start`), what its
settings need from the rest of the training config (`check_run`), how an export's card and
``compressor.init_from`` describe and compare it.

- ``mean``: the masked mean of the context's token states (the specification's summary);
  ``chunk_tokens`` = C > 0: one latent per chunk of C consecutive tokens, so a context of S
  tokens sends ceil(S / C) latents.
- ``attention``: ``pool_queries`` learned queries (`AttentionPooler`), the VAE reading
  queries x D floats; chunks as for ``mean``.
- ``concat``: the token codec: chunks of C tokens whose states the VAE reads side by side
  (`ConcatPooler`); with K = C memory vectors, read in the prompt as tokens.
- ``slots`` (`ilcp.encoder.slot_memory`): learned tokens the sender's LM reads after the
  context, one latent each, their number growing with the context.

The kinds are registered in `ilcp.names.MEMORY_KINDS` (name -> ``"module:Class"``); a kind's
module imports the standard library alone at import time (torch only inside the methods that
build modules), so that a config naming it is checked before torch loads. A new kind is one
module and one registry entry (`register_memory_kind` adds one at run time):

    @dataclass(frozen=True)
    class RecurrentMemory(MemoryKind):
        kind: ClassVar[str] = "recurrent"
        state_slots: int = setting(4, "recurrent state vectors", minimum=1, maximum=MAX_COUNT)

        def pooler(self, state_dim, hidden_size=None):   # its own trainable module (pooler.* weights)
            from .recurrent_pooler import RecurrentPooler
            return RecurrentPooler(state_dim, self.state_slots)

Its pooler is the kind's own module: its parameters train with the encoder and are exported as
``pooler.*`` entries of model.safetensors. A kind whose encoder reads the sender's LM (or the
context's token ids) sets ``reads_sender_lm`` and returns its encoder from `start`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..names import MEMORY_KINDS, resolve
from ..settings import check_value, declared, setting

if TYPE_CHECKING:
    from .compressor import BetaVAE
    from .model import ILCPEncoder
    from .pooling import Pooler
    from .projector import GatedLatentToMemoryProjector

__all__ = ["MAX_COUNT", "MemoryKind", "MeanMemory", "AttentionMemory", "CodecMemory", "register_memory_kind",
           "memory_kinds", "memory_kind_for", "memory_kind_of", "memory_from_settings", "legacy_pooling",
           "config_value"]


# The largest count any memory kind's setting may hold (queries, tokens per chunk or slot, slots,
# adapter rank): far above what any recipe uses, far below what would exhaust memory when built.
MAX_COUNT = 1 << 16
# config.json's ``pooling`` entries that belong to the spec (`EncoderSpec`), not to the kind
SPEC_ENTRIES = ("layers", "max_length")

# how a setting is named in the errors of the object being read: "'pooling.{}'" for config.json,
# "compressor.memory.{}" for the training config, "{}" for a kind built in code
_NAMING = contextvars.ContextVar("memory_naming", default="{}")


def config_value(config: dict, dotted: str, kind, *, minimum=None, maximum=None, required: bool = True,
                 default=None):
    """The entry ``dotted`` ("pooling.layers") of a config.json object, of type `kind` (int,
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

    ``kind`` (class attribute) is the registry's key, config.json's ``pooling.kind`` and the
    training config's ``compressor.memory.kind``; every field is a setting declared with
    `ilcp.settings.setting` and checked on construction.
    """

    kind: ClassVar[str]
    reads_sender_lm: ClassVar[bool] = False  # its encoder runs the sender's LM itself (no cached states)
    # its encoder is usable as `start` builds it (pretrained elsewhere or readable as it starts), so
    # handoff.max_steps=0 may export it with no training in the run
    exports_as_started: ClassVar[bool] = False

    def __post_init__(self):
        for d in declared(self):
            value = getattr(self, d.name)
            if isinstance(value, list):  # a list read from YAML or JSON: frozen, so the kind stays hashable
                value = tuple(value)
                object.__setattr__(self, d.name, value)
            check_value(self.name_of(d.name), value, d.type, d.meta)
        self.check()

    @staticmethod
    def name_of(name: str) -> str:
        """A setting's name as the object being read calls it ("'pooling.pool_queries'")."""
        return _NAMING.get().format(name)

    def check(self) -> None:
        """The kind's checks across its own settings (ValueError naming them)."""

    # ------------------------------------------------------------------ what training asks

    @property
    def chunk_tokens(self) -> int:
        """C > 0: one latent per chunk of C tokens; 0: not chunked."""
        return 0

    @property
    def reads_token_states(self) -> bool:
        """Whether training caches every token's state (else one mean-pooled state per context)."""
        return True

    @property
    def one_latent_per_context(self) -> bool:
        """Whether a context sends exactly one latent (what stage 1's answer head reads)."""
        return self.chunk_tokens == 0 and not self.reads_sender_lm

    @property
    def attention_queries(self) -> int:
        """Learned queries over the whole context (what stage 1's story attention teaches), or 0."""
        return 0

    def check_run(self, cfg) -> None:
        """What these settings need from the rest of the training config `cfg` (a
        `ilcp.config.TrainConfig`); ValueError naming the settings."""

    def start(self, cfg, lm, train) -> ILCPEncoder | None:
        """The encoder of a kind that does not fit stage 1 on cached states (bound to the sender
        LM `lm`, standardised on the training rows `train`), or None: stage 1 fits its VAE."""
        return None

    # ------------------------------------------------------------------ config.json and the card

    def entries(self) -> dict:
        """This kind's entries of config.json's ``pooling`` object ("kind" and its exported settings)."""
        out, written = {"kind": self.kind}, set()
        for d in declared(self):
            value = getattr(self, d.name)
            if not d.meta.get("exported", True) or (d.meta.get("omit_default") and value == d.default):
                continue
            if d.meta.get("written_with") and d.meta["written_with"] not in written:
                continue
            out[d.key] = list(value) if isinstance(value, tuple) else value
            written.add(d.name)
        return out

    @classmethod
    def from_entries(cls, entries: dict) -> MemoryKind:
        """The kind a ``pooling`` object of config.json describes (after `legacy_pooling`); other
        kinds' and the spec's entries are not read. ValueError naming ``'pooling.ENTRY'``."""
        values = {}
        for d in declared(cls):
            if not d.meta.get("exported", True):
                continue
            if d.key not in entries:
                if d.default is dataclasses.MISSING or not (d.meta.get("omit_default") or d.meta.get("optional")
                                                          or d.meta.get("written_with")):
                    raise ValueError(f"missing 'pooling.{d.key}'")
                continue
            values[d.name] = entries[d.key]
        token = _NAMING.set("'pooling.{}'")
        try:
            return cls(**values)
        finally:
            _NAMING.reset(token)

    def settings(self) -> dict:
        """The training config's ``compressor.memory`` section: "kind" and every setting."""
        values = {d.name: getattr(self, d.name) for d in declared(self) if d.meta.get("configurable", True)}
        return {"kind": self.kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}}

    @classmethod
    def describe_settings(cls, prefix: str = "compressor.memory.") -> list[tuple[str, str]]:
        """``[(setting, help with default and bounds)]`` of this kind's settings (``--help``)."""
        return [(f"{prefix}{d.name}", f"[{cls.kind}] {d.describe()}") for d in declared(cls)
                if d.meta.get("configurable", True)]

    def differences(self, other: MemoryKind, prefix: str = "compressor.memory.") -> dict[str, tuple]:
        """``{setting: (this value, other's value)}`` for every setting that shapes the encoder and
        differs (``compressor.init_from``): the kind itself, or its compared settings."""
        if type(other) is not type(self):
            return {f"{prefix}kind": (self.kind, other.kind),
                    **{f"{prefix}{k}": (None, v) for k, v in other.settings().items() if k != "kind"}}
        return {f"{prefix}{f.name}": (getattr(self, f.name), getattr(other, f.name)) for f in dataclasses.fields(self)
                if f.compare and getattr(self, f.name) != getattr(other, f.name)}

    def describe(self) -> str:
        """What the card calls this memory ("attention pooling")."""
        return f"{self.kind} pooling"

    def card_unit(self) -> str:
        """What one latent stands for, on the card ("one per context")."""
        return f"one per {self.chunk_tokens} context tokens" if self.chunk_tokens else "one per context"

    # ------------------------------------------------------------------ the modules

    @classmethod
    def from_encoder(cls, encoder: ILCPEncoder) -> MemoryKind | None:
        """The settings of an encoder of this kind built without it (`memory_kind_of` reads the
        kind an encoder was built by first); None when the encoder is of another kind."""
        return None

    def pooler(self, state_dim: int, hidden_size: int | None = None) -> Pooler | None:
        """An untrained pooler (the kind's own trainable module, exported as ``pooler.*``) for
        token states of width `state_dim`, or None for the masked mean; `hidden_size` is the LM's."""
        return None

    def encoder(self, vae: BetaVAE, projector: GatedLatentToMemoryProjector | None, pooler: Pooler | None,
                **receiver) -> ILCPEncoder:
        """The encoder module of this kind around its parts; `receiver` are the `ILCPEncoder`
        receiver settings (placement, format_prompt, vocabulary_snap, ...)."""
        from .model import ILCPEncoder

        encoder = ILCPEncoder(vae, projector, pooler, chunk_tokens=self.chunk_tokens, **receiver)
        encoder.memory_kind = self
        return encoder


_KINDS: dict[str, type[MemoryKind]] = {}  # the kinds register_memory_kind added at run time


def _registered(name: str) -> type[MemoryKind]:
    """The settings class `ilcp.names.MEMORY_KINDS` registers under `name`, imported, checked."""
    cls = resolve(MEMORY_KINDS[name].target)
    if not (isinstance(cls, type) and issubclass(cls, MemoryKind)) or cls.kind != name:
        raise ValueError(f"ilcp.names.MEMORY_KINDS[{name!r}] names {cls!r}, not a MemoryKind named {name!r}")
    return cls


def register_memory_kind(cls: type[MemoryKind]) -> type[MemoryKind]:
    """Class decorator: add a memory kind under ``cls.kind`` (once) at run time."""
    if not (isinstance(cls, type) and issubclass(cls, MemoryKind)):
        raise ValueError(f"a memory kind subclasses MemoryKind, got {cls!r}")
    taken = memory_kinds().get(cls.kind)
    if taken is not None and taken is not cls:
        raise ValueError(f"a memory kind named {cls.kind!r} is already registered ({taken.__name__})")
    _KINDS[cls.kind] = cls
    return cls


def memory_kinds() -> dict[str, type[MemoryKind]]:
    """Name -> settings class of every kind: those of `ilcp.names.MEMORY_KINDS` in its order, then
    those registered at run time."""
    kinds = {name: _registered(name) for name in MEMORY_KINDS}
    return {**kinds, **{name: cls for name, cls in _KINDS.items() if name not in kinds}}


def legacy_pooling(pooling: dict) -> dict:
    """The one reading of ``pooling`` objects exports wrote before the kinds were their own
    configs: no ``kind`` is the masked mean, and ``num_queries`` (the attention pooler's queries,
    before the entry took the training config's name) is ``pool_queries``. An object in the
    current shape comes back as it is."""
    if not isinstance(pooling, dict):
        raise ValueError(f"'pooling' must be an object, got {pooling!r}")
    pooling = {"kind": "mean", **pooling}
    if "num_queries" in pooling:
        if "pool_queries" in pooling:
            raise ValueError("'pooling' names its queries twice: 'pool_queries' and the older 'num_queries'")
        pooling["pool_queries"] = pooling.pop("num_queries")
    return pooling


def memory_kind_for(pooling: dict) -> MemoryKind:
    """The settings config.json's ``pooling`` object describes, checked.

    Raises:
        ValueError: no registered kind reads it, or an entry is missing or wrong (one line).
    """
    pooling = legacy_pooling(pooling)
    kinds = memory_kinds()
    cls = kinds.get(pooling["kind"]) if isinstance(pooling["kind"], str) else None
    if cls is None:
        raise ValueError(f"unknown pooling kind {pooling['kind']!r} in config.json (this package reads "
                         f"{', '.join(kinds)})")
    return cls.from_entries({k: v for k, v in pooling.items() if k not in SPEC_ENTRIES})


def memory_from_settings(section: dict, default: MemoryKind, prefix: str = "compressor.memory.") -> MemoryKind:
    """The training config's ``compressor.memory`` section: its ``kind`` (absent: `default`'s
    kind, whose settings are then the defaults) and that kind's settings, checked by the kind.

    Raises:
        ValueError: one line naming the setting (an unknown kind or setting, a wrong value).
    """
    if not isinstance(section, dict):
        raise ValueError(f"{prefix.rstrip('.')} must be a mapping with its 'kind', got {section!r}")
    kinds = memory_kinds()
    name = section.get("kind", default.kind)
    cls = kinds.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"{prefix}kind must be one of {', '.join(kinds)}, got {name!r}")
    known = {d.name: d for d in declared(cls) if d.meta.get("configurable", True)}
    unknown = sorted(set(section) - set(known) - {"kind"}, key=str)
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]} is not a setting of memory kind {name!r} (its settings: "
                         f"{', '.join(known) or 'none'})")
    values = {}
    for key, value in section.items():
        if key == "kind":
            continue
        if isinstance(value, str) and known[key].type in (float, "float"):
            try:
                value = float(value)  # YAML 1.1 reads "3e-3" (no dot) as a string
            except ValueError:
                pass
        values[key] = value
    token = _NAMING.set(prefix + "{}")
    try:
        return cls(**values)
    finally:
        _NAMING.reset(token)


def memory_kind_of(encoder: ILCPEncoder) -> MemoryKind:
    """The settings of an encoder's kind: the kind that built it (`MemoryKind.encoder`), else the
    kind whose `from_encoder` recognises it."""
    held = getattr(encoder, "memory_kind", None)
    if held is not None:
        return held
    for cls in memory_kinds().values():
        settings = cls.from_encoder(encoder)
        if settings is not None:
            return settings
    raise ValueError(f"no registered memory kind builds an encoder that pools with {encoder.pooling!r} "
                     f"and chunks of {encoder.chunk_tokens} tokens")


# --------------------------------------------------------------------------------------------
# the built-in kinds that read cached token states


@dataclass(frozen=True)
class MeanMemory(MemoryKind):
    """The masked mean of the context's token states, one latent per context or per chunk."""

    kind: ClassVar[str] = "mean"

    chunk_tokens: int = setting(0, "one latent per chunk of this many context tokens, each through the same VAE, "
                                   "so the payload grows with the context (0 = one latent per context, the spec)",
                                minimum=0, maximum=MAX_COUNT, omit_default=True)

    @property
    def reads_token_states(self) -> bool:
        return self.chunk_tokens > 0  # one latent per context: the mean is computed ahead of time

    @classmethod
    def from_encoder(cls, encoder: ILCPEncoder) -> MemoryKind | None:
        if encoder.pooler is not None or encoder.reads_sender_lm:
            return None
        return cls(chunk_tokens=encoder.chunk_tokens)


@dataclass(frozen=True)
class AttentionMemory(MemoryKind):
    """`pool_queries` learned attention queries over the token states (the VAE reads queries x
    D floats), one latent per context or per chunk."""

    kind: ClassVar[str] = "attention"

    pool_queries: int = setting(4, "learned queries (the VAE reads queries x hidden floats)", minimum=1,
                                maximum=MAX_COUNT)
    chunk_tokens: int = setting(0, "one latent per chunk of this many context tokens (0 = one per context)",
                                minimum=0, maximum=MAX_COUNT, omit_default=True)

    @property
    def attention_queries(self) -> int:
        return self.pool_queries if self.chunk_tokens == 0 else 0

    def check_run(self, cfg) -> None:
        taught = cfg.handoff.finetune_encoder or cfg.compressor.answer_head_weight > 0 or cfg.reconstruct.enabled
        if "ilcp" in cfg.handoff.variants and not taught:
            raise ValueError("compressor.memory.kind=attention needs handoff.finetune_encoder=true, "
                             "compressor.answer_head_weight > 0 or reconstruct.steps > 0 (nothing else teaches the "
                             "pooler's queries)")

    @classmethod
    def from_encoder(cls, encoder: ILCPEncoder) -> MemoryKind | None:
        if getattr(encoder.pooler, "kind", None) != "attention":
            return None
        return cls(pool_queries=encoder.pooler.num_queries, chunk_tokens=encoder.chunk_tokens)

    def pooler(self, state_dim: int, hidden_size: int | None = None):
        from .pooling import AttentionPooler

        return AttentionPooler(state_dim, self.pool_queries)


@dataclass(frozen=True)
class CodecMemory(MemoryKind):
    """The token codec: chunks of `chunk_tokens` tokens whose states the VAE reads side by side (a
    parameter-free `ConcatPooler`), so a latent keeps which token stood where; trained with K = C
    and the token loss, memory vector j reads as the chunk's j-th token."""

    kind: ClassVar[str] = "concat"

    chunk_tokens: int = setting(4, "tokens per chunk, their states read side by side", minimum=1, maximum=MAX_COUNT)

    @classmethod
    def from_encoder(cls, encoder: ILCPEncoder) -> MemoryKind | None:
        return cls(chunk_tokens=encoder.chunk_tokens) if getattr(encoder.pooler, "kind", None) == "concat" else None

    def pooler(self, state_dim: int, hidden_size: int | None = None):
        from .pooling import ConcatPooler

        return ConcatPooler(state_dim, self.chunk_tokens)
