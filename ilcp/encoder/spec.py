"""The exported encoder settings: one typed, versioned dataclass that writes and reads config.json.

    spec = EncoderSpec.from_encoder(encoder, layers=[-1], max_length=512)
    config.update(spec.to_config())                        # the encoder's entries of config.json
    spec = EncoderSpec.from_config(config, "run/config.json")  # checked; ExportError names file and entry
    encoder = spec.build(hidden_size=576)                  # untrained, ready for the export's weights

Every setting is one field declared as every setting of the package is (`ilcp.settings.setting`:
its config.json entry, dotted "compressor.beta", and its bounds and choices), so a new setting is
one line here. The memory kind (`ilcp.encoder.kinds`: pooled,
chunked or codec) owns its own entries of the ``pooling`` object. `EncoderSpec.VERSION` is the
export's ``format_version``: a new optional setting with a default keeps it (older exports read
the default); a setting whose meaning changes raises it.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch

from .compressor import BetaVAE
from .model import FormatPrompt, ILCPEncoder
from .kinds import MemoryKind, config_value, memory_kind_for, memory_kind_of
from ..settings import check_value, setting
from ..names import MEMORY_PLACEMENTS, SNAP_METRICS, VOCABULARY_SNAPS
from .projector import GatedLatentToMemoryProjector

__all__ = ["MAX_PARAMETERS", "EncoderSpec", "ExportError", "NORMALISATION"]

NORMALISATION = "model.safetensors: compressor.input_mean, compressor.input_std (train split)"


class ExportError(ValueError):
    """An export directory is missing, incomplete, or made for another LM."""


def _entry(key: str, default=MISSING, help: str = "", **declared):
    """A field of `EncoderSpec` written as config.json entry `key`: a declared setting
    (`ilcp.settings.setting`: bounds, choices, ``omit_default``, ``written_with``, ``optional``)."""
    return setting(default, help, key=key, **declared)


_TYPES = {"int": int, "float": float, "str": str, "tuple[int, ...]": list}  # how config.json holds each

# Documented maxima of the sizes config.json holds, checked when it is read, before anything is
# built: far above every recipe, far below what would exhaust memory. The parameters they build
# together are bounded too (`MAX_PARAMETERS`, against the LM's width), before any is allocated.
MAX_WIDTH = 1 << 16  # latent_dim, compressor.hidden_dim, projector.hidden
MAX_INPUT = 1 << 20  # compressor.input_dim (token states side by side for the codec)
MAX_VECTORS = 1 << 12  # num_memory_tokens, format_vectors
MAX_LENGTH = 1 << 20  # pooling.max_length, tokens
MAX_LAYERS = 256  # pooling.layers
MAX_PARAMETERS = 1 << 30  # the encoder's parameters together (4 GiB in float32)


@dataclass(frozen=True)
class EncoderSpec:
    """Every exported setting of an `ILCPEncoder` (the LM's hidden size belongs to the run's ``lm``)."""

    VERSION: ClassVar[int] = 1

    latent_dim: int = _entry("latent_dim", minimum=1, maximum=MAX_WIDTH)  # Z, the floats of one latent
    num_memory_tokens: int = _entry("num_memory_tokens", minimum=1, maximum=MAX_VECTORS)  # K, memory vectors per latent
    input_dim: int = _entry("compressor.input_dim", minimum=1, maximum=MAX_INPUT)  # the VAE's input width
    hidden_dim: int = _entry("compressor.hidden_dim", minimum=1, maximum=MAX_WIDTH)  # the VAE's body width
    beta: float = _entry("compressor.beta", minimum=0)  # the KL weight
    projector_hidden: int = _entry("projector.hidden", minimum=1, maximum=MAX_WIDTH)  # the projector's trunk width
    layers: tuple[int, ...] = _entry("pooling.layers")  # hidden-state layers read, concatenated
    max_length: int = _entry("pooling.max_length", minimum=1, maximum=MAX_LENGTH)  # context tokens the sender reads
    memory: MemoryKind = _entry("pooling")  # the memory kind and its own settings (`ilcp.encoder.kinds`)
    memory_placement: str = _entry("memory_placement", "prefix", choices=MEMORY_PLACEMENTS, omit_default=True)
    format_vectors: int = _entry("format_vectors", 0, minimum=0, maximum=MAX_VECTORS, omit_default=True)
    vocabulary_snap: str = _entry("vocabulary_snap.mode", "none", choices=VOCABULARY_SNAPS, omit_default=True)
    snap_temperature: float = _entry("vocabulary_snap.temperature", 0.02, above=0, written_with="vocabulary_snap")
    snap_metric: str = _entry("vocabulary_snap.metric", "cosine", choices=SNAP_METRICS,
                               written_with="vocabulary_snap", optional=True)

    def __post_init__(self):
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if f.name == "memory":
                if not isinstance(value, MemoryKind):
                    raise ValueError(f"memory must be the settings of a registered memory kind, got {value!r}")
            elif f.name == "layers":
                if not value or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
                    raise ValueError(f"'pooling.layers' must be a non-empty list of ints, got {list(value)!r}")
                if len(value) > MAX_LAYERS:
                    raise ValueError(f"'pooling.layers' must name at most {MAX_LAYERS} layers, got {len(value)}")
                object.__setattr__(self, "layers", tuple(value))
            else:
                check_value(repr(meta["key"]), value, _TYPES[f.type], meta)

    # ------------------------------------------------------------------------------ config.json

    def to_config(self) -> dict:
        """The encoder's entries of config.json (`from_config` reads them back)."""
        config: dict = {}
        written = set()
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if f.name == "memory":
                _put(config, "pooling", value.entries())
                continue
            if meta["omit_default"] and value == f.default:
                continue
            if meta["written_with"] is not None and meta["written_with"] not in written:
                continue
            _put(config, meta["key"], list(value) if isinstance(value, tuple) else value)
            written.add(f.name)
        config["normalisation"] = NORMALISATION
        return config

    @classmethod
    def from_config(cls, config: dict, where: str | Path = "config.json") -> EncoderSpec:
        """The settings of an export's config.json, checked.

        Raises:
            ExportError: one line naming `where` and the entry (missing, of the wrong type, out of range).
        """
        try:
            values = {}
            for f in fields(cls):
                meta = f.metadata
                if f.name == "memory":
                    values["memory"] = memory_kind_for(config["pooling"])
                    continue
                # an entry inside an object (vocabulary_snap.mode) is required when its object is there
                parent = meta["key"].rpartition(".")[0]
                absent_ok = f.default is not MISSING and (
                    meta["optional"] or (parent not in config if parent else meta["omit_default"]))
                value = config_value(config, meta["key"], _TYPES[f.type], required=not absent_ok, default=MISSING)
                if value is not MISSING:
                    values[f.name] = tuple(value) if isinstance(value, list) else value
            return cls(**values)
        except ValueError as e:
            raise ExportError(f"{where}: {e}") from None

    @classmethod
    def config_keys(cls) -> set[str]:
        """The top-level config.json keys `to_config` may write."""
        return {f.metadata["key"].split(".")[0] for f in fields(cls)} | {"normalisation"}

    @classmethod
    def from_encoder(cls, encoder: ILCPEncoder, layers, max_length: int) -> EncoderSpec:
        """The settings of an encoder with its projector, which reads hidden-state `layers` of
        contexts of up to `max_length` tokens."""
        vae, projector = encoder.vae, encoder._projector()
        return cls(
            latent_dim=vae.latent_dim, num_memory_tokens=projector.num_memory_tokens, input_dim=vae.input_dim,
            hidden_dim=vae.hidden_dim, beta=vae.beta, projector_hidden=projector.hidden,
            layers=tuple(int(i) for i in layers), max_length=int(max_length), memory=memory_kind_of(encoder),
            memory_placement=encoder.placement,
            format_vectors=encoder.format_prompt.num_vectors if encoder.format_prompt is not None else 0,
            vocabulary_snap=encoder.vocabulary_snap, snap_temperature=encoder.snap_temperature,
            snap_metric=encoder.snap_metric,
        )

    # ------------------------------------------------------------------------------ the module

    def build(self, hidden_size: int) -> ILCPEncoder:
        """An untrained `ILCPEncoder` of these settings for an LM of `hidden_size` (format vectors zero).

        Raises:
            ExportError: the parameters these settings build for this LM's width are more than
                `MAX_PARAMETERS` (counted on the meta device, before any is allocated), naming the
                largest part and the entries that size it.
        """
        self.check_parameters(hidden_size)
        return self._build(hidden_size)

    def check_parameters(self, hidden_size: int) -> int:
        """The parameters these settings build for an LM of `hidden_size`, counted without
        allocating any; ExportError over `MAX_PARAMETERS`."""
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            parts = {name: sum(p.numel() for p in module.parameters())
                     for name, module in self._build(hidden_size).named_children()}
        total = sum(parts.values())
        if total > MAX_PARAMETERS:
            largest = max(parts, key=parts.get)
            raise ExportError(f"these encoder settings build {total:,} parameters for an LM of width {hidden_size} (the "
                              f"{largest} {parts[largest]:,}), more than {MAX_PARAMETERS:,}: check latent_dim, "
                              "num_memory_tokens, compressor.hidden_dim, compressor.input_dim, projector.hidden and "
                              "the pooling entries")
        return total

    def _build(self, hidden_size: int) -> ILCPEncoder:
        # the pooler first, then the VAE and the projector: the order training builds them in,
        # so a build draws the same random numbers wherever it runs
        pooler = self.memory.pooler(hidden_size * len(self.layers), hidden_size=hidden_size)
        vae = BetaVAE(self.input_dim, self.latent_dim, self.hidden_dim, self.beta)
        projector = GatedLatentToMemoryProjector(self.latent_dim, self.num_memory_tokens, hidden_size,
                                                 self.projector_hidden)
        format_prompt = FormatPrompt(torch.zeros(self.format_vectors, hidden_size)) if self.format_vectors else None
        return self.memory.encoder(vae, projector, pooler, placement=self.memory_placement,
                                   format_prompt=format_prompt, vocabulary_snap=self.vocabulary_snap,
                                   snap_temperature=self.snap_temperature, snap_metric=self.snap_metric)


def _put(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    if isinstance(value, dict):
        node.setdefault(last, {}).update(value)
    else:
        node[last] = value
