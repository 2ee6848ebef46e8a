"""The handoff payload: a latent tensor, packed at the gradient boundary and sent as bytes.

`pack(z, lm_fingerprint=...)` detaches the sender's latent z, casts (or quantises) it to the
payload dtype and stages it; `TransportPayload.to_bytes()` serialises it; the receiver calls
`TransportPayload.from_bytes(data, expected_fingerprint=...)`, which verifies everything, and
`unpack(payload, device)` for its own copy of z. In-process handoffs skip the bytes; a network
transport (gRPC, a shared-memory ring) sends them without touching call sites.

Latent shapes: ``(Z,)`` one latent; ``(B, Z)`` a batch of one latent per context, or ``(N, Z)``
one context carried by N latents (one per chunk or sentence); ``(B, N, Z)`` a batch of those.
The payload keeps the shape and nothing else: whether a 2-D latent is (B, Z) or (N, Z) is the
caller's contract. ``latent_dim`` is always the last dimension.

Payload dtypes (``dtype=`` of `pack`, a name or the torch dtype):
- ``"float32"``, ``"float16"``, ``"bfloat16"``: the latent cast to that dtype; float32 round-trips
  exactly.
- ``"int8"``: symmetric absmax quantisation per row (per latent vector, the last axis): for a
  row x, ``scale = max|x| / 127`` stored as float32 (rounded up, so that ``|x / scale| <= 127``),
  ``q = round(x / scale)`` in -127..127 (-128 is never written and is refused when read); an
  all-zero row has scale 0 and q 0. `unpack` dequantises to ``q * scale`` in float32 (or the
  float dtype asked for); each value is off by at most ``scale / 2`` (plus float32 rounding of
  the product).

Two sizes, both reported by evaluation:
- ``payload.byte_length()``: the tensor bytes actually carried, computed from the real tensors:
  numel x element_size of the latent, plus, for int8, the float32 scales (4 bytes per row).
  32 x float32 = 128 bytes (the article's payload figure); 32 x int8 + one scale = 36 bytes.
- ``wire_length(payload) == len(payload.to_bytes())``: the bytes on the wire, header and CRC
  included (``header + byte_length() + 4``).

Wire format (all integers little-endian, ``struct`` format ``'<'``):

| offset      | size          | field                                                         |
|-------------|---------------|---------------------------------------------------------------|
| 0           | 4             | magic ``b"ILCP"``                                             |
| 4           | 1             | format version, uint8: 1 or 2 (below)                         |
| 5           | 1             | dtype code, uint8: 1 float32, 2 float16, 3 bfloat16, 4 int8   |
| 6           | 4             | ndim n, uint32: 1 or 2 in version 1; 1, 2 or 3 in version 2   |
| 10          | 4 x n         | shape, uint32 each, every dimension >= 1                      |
| 10 + 4n     | 1             | fingerprint length F, uint8, 1..64                            |
| 11 + 4n     | F             | LM fingerprint, utf-8                                         |
| 11 + 4n + F | T             | tensor section (below)                                        |
| end - 4     | 4             | CRC32 (zlib) of every byte before it, uint32                  |

Tensor section: for float dtypes, numel values, row-major, little-endian (bfloat16 as its raw
16 bits), T = numel x element size. For int8 (code 4): R = numel / shape[-1] float32 scales
(one per row, row-major), then numel int8 values, row-major; T = 4R + numel.

Versions. Version 1 is the original format: float dtypes, 1 or 2 dims; its bytes are unchanged.
Version 2 has the same header and adds dtype code 4 (int8, whose tensor section carries the
scales) and 3 dims. The writer uses the lowest version that can express the payload: every
float payload of 1 or 2 dims is still written as version 1, byte for byte, so receivers that
read only version 1 keep reading everything they could read before, and refuse the rest with
"unknown payload format version 2" (the accurate reason: they are older than the sender)
instead of misreading it. A version-2 payload that version 1 could express, and a version-1
payload with int8 or 3 dims, are refused as non-canonical: every payload has exactly one
encoding, so ``from_bytes(b).to_bytes() == b`` for every accepted ``b``.

Authenticated payloads. CRC32 catches accidents, not edits: anyone can change a payload and
recompute it. With a shared key (`seal` / `open_sealed`, or ``key=`` of `to_bytes` and
`from_bytes`), the payload travels in an envelope (integers little-endian):

| offset | size | field                                                                      |
|--------|------|----------------------------------------------------------------------------|
| 0      | 4    | magic ``b"ILCA"``                                                          |
| 4      | 1    | envelope version, uint8: 2 (version 1, written before, has no nonce/time)  |
| 5      | 16   | nonce: random bytes, new for every seal                                    |
| 21     | 8    | creation time, uint64 milliseconds since the Unix epoch (the sender's clock) |
| 29     | P    | the payload bytes above                                                    |
| end-32 | 32   | HMAC-SHA256(key, every byte before it)                                     |

A version-1 envelope is the magic, the version byte, the payload and the tag. A receiver
holding the key refuses any envelope whose tag does not verify (every deliberate edit made
without the key), and refuses an unsealed payload; a receiver without a key refuses an envelope
with "authenticated payload: a shared key is needed". Without a key the format above is
unchanged.

What the envelope promises, under a key only its holders know: the payload was sealed by one of
them and not changed since; with a `ReplayGuard` (``guard=`` of `from_bytes`; every
`ILCPHandoff` with a key has one), the same sealed bytes are accepted once within the guard's
window, and an envelope older than its ``max_age`` (or dated more than ``max_skew`` ahead of the
receiver's clock) is refused, as is a version-1 envelope, which has no nonce. What it does not
promise: secrecy (the latent travels in clear); that the sender is one particular holder of the
key (any holder can seal); delivery or order; replay protection across receivers or across
restarts of one receiver (each guard remembers only its own nonces, in memory); clocks in step
(creation times are the sender's, checked against the receiver's within ``max_skew``).

`from_bytes` raises `PayloadError` (a ValueError) with the reason for anything that is not a
valid payload: not bytes-like, over the size limit, truncated, bad magic, unknown or
non-canonical version, unknown dtype code, bad shape, trailing bytes, CRC mismatch, non-finite
values (for int8, also after dequantisation), a negative scale or an int8 value of -128, or a
fingerprint that differs from the receiver's LM. It raises nothing else for any input. The size
limit (``max_elements``, default `DEFAULT_MAX_ELEMENTS`) is checked against the shape the
header declares before anything proportional to the payload is allocated: the parser reads the
caller's buffer through a memoryview and copies nothing before that check. CRC32 detects every
error of up to four flipped bits in payloads of this size, and any burst of up to 32 bits.
"""

from __future__ import annotations

import hashlib
import hmac
import heapq
import math
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import check_key, positive_int

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "DTYPES",
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "MAGIC",
    "MAX_NDIM",
    "Envelope",
    "PayloadError",
    "ReplayGuard",
    "TransportPayload",
    "pack",
    "unpack",
    "wire_length",
]

MAGIC = b"ILCP"
FORMAT_VERSIONS = (1, 2)
FORMAT_VERSION = FORMAT_VERSIONS[-1]  # the newest version this module reads and writes
MAX_FINGERPRINT_BYTES = 64
MAX_NDIM = 3  # (B, N, Z)
_MAX_NDIM_BY_VERSION = {1: 2, 2: MAX_NDIM}
DEFAULT_MAX_ELEMENTS = 1 << 22  # latent values per payload a receiver accepts by default (16 MiB of float32)

# name -> (dtype code, torch dtype of the payload's latent, little-endian numpy dtype of the raw values)
_DTYPES = {
    "float32": (1, torch.float32, np.dtype("<f4")),
    "float16": (2, torch.float16, np.dtype("<f2")),
    "bfloat16": (3, torch.bfloat16, np.dtype("<i2")),
    "int8": (4, torch.int8, np.dtype("i1")),
}
DTYPES = tuple(_DTYPES)
_CODES = {code: name for name, (code, _, _) in _DTYPES.items()}
_TORCH_NAMES = {tdtype: name for name, (_, tdtype, _) in _DTYPES.items()}
_QUANTISED = frozenset({"int8"})
_SCALE_NP = np.dtype("<f4")
_INT8_MAX = 127

_PREFIX = struct.Struct("<4sBBI")  # magic, version, dtype code, ndim
_U32 = struct.Struct("<I")
_U8 = struct.Struct("<B")
_MAX_HEADER = _PREFIX.size + 4 * MAX_NDIM + 1 + MAX_FINGERPRINT_BYTES


class PayloadError(ValueError):
    """Bytes that are not a valid payload for this receiver; the message gives the reason."""


def _dtype_name(dtype: str | torch.dtype) -> str:
    """The payload dtype name for a name or torch dtype; ValueError for anything else."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_NAMES:
            raise ValueError(f"payload dtype must be one of {sorted(_DTYPES)}, got {dtype}")
        return _TORCH_NAMES[dtype]
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"payload dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    return dtype


def _check_fingerprint(fp) -> bytes:
    if not isinstance(fp, str) or not fp:
        raise ValueError(f"lm_fingerprint must be a non-empty str, got {fp!r}")
    raw = fp.encode("utf-8")
    if len(raw) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"lm_fingerprint is {len(raw)} bytes in utf-8; at most {MAX_FINGERPRINT_BYTES}")
    return raw


def _format_version(name: str, ndim: int) -> int:
    """The lowest format version that expresses a payload of this dtype and rank."""
    return 1 if name not in _QUANTISED and ndim <= _MAX_NDIM_BY_VERSION[1] else 2


def _tensor_section_bytes(name: str, shape: tuple[int, ...]) -> int:
    numel = math.prod(shape)
    if name in _QUANTISED:
        return _SCALE_NP.itemsize * (numel // shape[-1]) + numel
    return numel * _DTYPES[name][2].itemsize


def _max_wire_bytes(max_elements: int) -> int:
    """An upper bound on the wire size of any payload of at most `max_elements` latent values:
    the longest header, then per value the wider of a float32 and (int8 with latent_dim 1) one
    int8 byte plus its float32 scale, then the CRC."""
    return _MAX_HEADER + max_elements * max(_DTYPES["float32"][2].itemsize, 1 + _SCALE_NP.itemsize) + 4


def _read_array(view: memoryview, np_dtype: np.dtype, count: int, offset: int) -> np.ndarray:
    """A native-order copy of `count` values at `offset`; keeps no reference to `view`."""
    return np.frombuffer(view, dtype=np_dtype, count=count, offset=offset).astype(np_dtype.newbyteorder("="))


def _quantise_int8(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row absmax int8: z (..., Z) finite -> (q int8 (..., Z), scale float32 (...)).

    The scale is max|row| / 127 rounded up to a float32, so every |x / scale| <= 127 and each
    dequantised value q * scale is within scale / 2 of x. Computed in float64 on the CPU.
    """
    x = z.detach().to(device="cpu", dtype=torch.float64)
    exact = x.abs().amax(dim=-1) / _INT8_MAX
    scale = exact.to(torch.float32)
    scale = torch.where(scale.double() < exact, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("z overflows int8: a row's scale max|x| / 127 is out of float32's range")
    s = scale.double().unsqueeze(-1)
    q = torch.where(s > 0, torch.round(x / torch.where(s > 0, s, 1.0)), 0.0)
    q = q.clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    if not bool(torch.isfinite(_dequantise(q, scale)).all()):
        raise ValueError("z overflows int8: its dequantised values are out of float32's range")
    return q, scale


def _dequantise(q: torch.Tensor, scale: torch.Tensor, device: str | torch.device | None = None) -> torch.Tensor:
    """int8 values (..., Z) and their float32 row scales (...) -> float32 (..., Z), q * scale."""
    return q.to(device=device, dtype=torch.float32) * scale.to(device=device, dtype=torch.float32).unsqueeze(-1)


@dataclass(frozen=True)
class TransportPayload:
    """A latent ready to cross the handoff.

    Attributes:
        latent: z, shaped (latent_dim,), (batch, latent_dim) or (N, latent_dim), or
            (batch, N, latent_dim); detached, contiguous, in the payload dtype (for int8 the
            quantised values q, -127..127).
        dtype: the payload dtype name: ``"float32"``, ``"float16"``, ``"bfloat16"`` or ``"int8"``.
        latent_dim: ``latent.shape[-1]``.
        lm_fingerprint: fingerprint of the LM whose pooled states produced z (`ilcp.lm`).
        scale: int8 only (None otherwise): float32 scales shaped ``latent.shape[:-1]``, one per
            row (0-dim for a (latent_dim,) latent); z is ``latent * scale[..., None]``.

    Build payloads with `pack`; the constructor checks that the fields agree (ValueError).
    """

    latent: torch.Tensor
    dtype: str
    latent_dim: int
    lm_fingerprint: str
    scale: torch.Tensor | None = None

    def __post_init__(self):
        t = self.latent
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"latent must be a tensor, got {type(t).__name__}")
        if not isinstance(self.dtype, str) or _dtype_name(self.dtype) != _TORCH_NAMES.get(t.dtype):
            raise ValueError(f"dtype {self.dtype!r} does not match the latent's dtype {t.dtype}")
        if not 1 <= t.dim() <= MAX_NDIM or t.numel() == 0:
            raise ValueError(
                f"latent must be (latent_dim,), (batch, latent_dim), (N, latent_dim) or (batch, N, latent_dim), "
                f"non-empty; got {tuple(t.shape)}"
            )
        if self.latent_dim != t.shape[-1]:
            raise ValueError(f"latent_dim {self.latent_dim} does not match the latent's shape {tuple(t.shape)}")
        if self.dtype in _QUANTISED:
            s = self.scale
            if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.shape != t.shape[:-1]:
                raise ValueError(
                    f"an {self.dtype} payload needs float32 scales shaped {tuple(t.shape[:-1])}, got "
                    f"{(s.dtype, tuple(s.shape)) if isinstance(s, torch.Tensor) else type(s).__name__}"
                )
        elif self.scale is not None:
            raise ValueError(f"a {self.dtype} payload carries no scale")
        _check_fingerprint(self.lm_fingerprint)

    @property
    def format_version(self) -> int:
        """The wire format version `to_bytes` writes: 1 for float dtypes of 1 or 2 dims, else 2."""
        return _format_version(self.dtype, self.latent.dim())

    def byte_length(self) -> int:
        """Tensor bytes carried: numel x element_size of the latent, plus the scales' bytes for
        int8 (128 for 32 x float32; 36 for 32 x int8 + one float32 scale)."""
        n = self.latent.numel() * self.latent.element_size()
        if self.scale is not None:
            n += self.scale.numel() * self.scale.element_size()
        return n

    def to_bytes(self, key: bytes | None = None) -> bytes:
        """The wire format described in the module docstring; with a shared ``key``, sealed in
        the authenticated envelope (`seal`).

        Raises:
            ValueError: the latent (or a scale) has NaN or infinite values, a scale is negative,
                an int8 value is -128, or int8 values dequantise to non-finite values (no
                receiver would accept them).
        """
        t = self.latent.detach().to("cpu").contiguous()
        if not bool(torch.isfinite(t).all()):
            raise ValueError("latent has non-finite values; refusing to serialise it")
        code, _, np_dtype = _DTYPES[self.dtype]
        fp = _check_fingerprint(self.lm_fingerprint)
        scales = b""
        if self.dtype in _QUANTISED:
            s = self.scale.detach().to("cpu").contiguous()
            if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
                raise ValueError("int8 scales must be finite and >= 0; refusing to serialise them")
            if bool((t == -_INT8_MAX - 1).any()):
                raise ValueError("int8 latent holds -128, outside the symmetric range -127..127")
            if not bool(torch.isfinite(_dequantise(t, s)).all()):
                raise ValueError("int8 latent dequantises to non-finite values; refusing to serialise it")
            scales = s.numpy().astype(_SCALE_NP, copy=False).tobytes()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        values = t.numpy().astype(np_dtype, copy=False).tobytes()
        body = b"".join([
            _PREFIX.pack(MAGIC, self.format_version, code, t.dim()),
            b"".join(_U32.pack(d) for d in t.shape),
            _U8.pack(len(fp)),
            fp,
            scales,
            values,
        ])
        wire = body + _U32.pack(zlib.crc32(body))
        return wire if key is None else seal(wire, key)

    @classmethod
    def from_bytes(
        cls,
        data,
        *,
        expected_fingerprint: str | None = None,
        device: str | torch.device = "cpu",
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        key: bytes | None = None,
        guard: ReplayGuard | None = None,
        check_shape: Callable[[tuple[int, ...]], None] | None = None,
    ) -> TransportPayload:
        """Parse and verify wire bytes (bytes, bytearray or memoryview) of either format version.

        Args:
            data: the bytes from `to_bytes`.
            expected_fingerprint: the receiver's LM fingerprint; a payload made by another LM is
                refused. None skips that check.
            device: where the latent (and an int8 payload's scales) are placed.
            max_elements: the most latent values accepted; a header declaring more is refused
                before anything proportional to its size is allocated or read.
            key: the shared key of authenticated payloads: the envelope's tag must verify
                (`open_sealed`), and unsealed bytes are refused. None: only unsealed payloads.
            guard: with a key, the receiver's `ReplayGuard`: a replayed, too old or version-1
                envelope is refused (its nonce is recorded once the tag verifies).
            check_shape: the receiver's own rules for the declared shape, called with it before
                anything proportional to it is read; raises PayloadError to refuse.

        Raises:
            PayloadError: with the reason, for any input that is not a valid payload.
            ValueError: ``max_elements`` is not a positive int.
        """
        positive_int("max_elements", max_elements)
        if key is not None:
            try:
                size = memoryview(data).nbytes if isinstance(data, (bytes, bytearray, memoryview)) else 0
            except (ValueError, TypeError, BufferError) as e:
                raise PayloadError(f"payload buffer is unreadable: {e}") from None
            if size > _max_wire_bytes(max_elements) + 64:
                raise PayloadError(f"payload of {size} bytes exceeds the limit of max_elements={max_elements}")
            envelope = open_envelope(data, key)
            if guard is not None:
                guard.check(envelope)
            data = envelope.payload
        elif is_sealed(data):
            raise PayloadError("authenticated payload: a shared key is needed to read it")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise PayloadError(f"payload must be bytes-like, got {type(data).__name__}")
        try:
            outer = memoryview(data)
        except (ValueError, TypeError, BufferError) as e:
            raise PayloadError(f"payload buffer is unreadable: {e}") from None
        with outer:
            try:
                view = outer.cast("B")
            except (ValueError, TypeError):
                # Not a C-contiguous buffer of a plain format: read it through a copy, bounded first.
                if outer.nbytes > _max_wire_bytes(max_elements):
                    raise PayloadError(
                        f"payload of {outer.nbytes} bytes exceeds the limit of max_elements={max_elements}"
                    ) from None
                try:
                    view = memoryview(outer.tobytes())
                except (ValueError, TypeError, BufferError) as e:
                    raise PayloadError(f"payload buffer is unreadable: {e}") from None
            with view:
                return cls._parse(view, expected_fingerprint, device, max_elements, check_shape)

    @classmethod
    def _parse(cls, data: memoryview, expected_fingerprint, device, max_elements: int,
               check_shape: Callable[[tuple[int, ...]], None] | None = None) -> TransportPayload:
        """`from_bytes` on a flat byte view; copies nothing before the size limit is checked."""
        n = data.nbytes

        def need(end: int, what: str) -> None:
            if n < end:
                raise PayloadError(f"truncated payload: {n} bytes, the {what} needs at least {end}")

        need(_PREFIX.size, "header")
        magic, version, code, ndim = _PREFIX.unpack_from(data, 0)
        if magic != MAGIC:
            raise PayloadError(f"bad magic {bytes(magic)!r}: not an ILCP payload (expected {MAGIC!r})")
        if version not in FORMAT_VERSIONS:
            raise PayloadError(
                f"unknown payload format version {version}; this receiver reads versions {list(FORMAT_VERSIONS)}"
            )
        if code not in _CODES:
            raise PayloadError(f"unknown dtype code {code}; known codes: {_CODES}")
        name = _CODES[code]
        max_ndim = _MAX_NDIM_BY_VERSION[version]
        if not 1 <= ndim <= max_ndim:
            raise PayloadError(f"bad shape: ndim {ndim}; format version {version} carries 1 to {max_ndim} dims")
        pos = _PREFIX.size
        need(pos + 4 * ndim + 1, "shape")
        shape = tuple(_U32.unpack_from(data, pos + 4 * i)[0] for i in range(ndim))
        if min(shape) == 0:
            raise PayloadError(f"bad shape {shape}: empty dimension")
        if check_shape is not None:  # the receiver's own rules first: they name what it reads
            check_shape(shape)
        numel = math.prod(shape)
        if numel > max_elements:
            raise PayloadError(
                f"payload declares shape {shape} ({numel} values), over the limit of max_elements={max_elements}"
            )
        canonical = _format_version(name, ndim)
        if version != canonical:
            raise PayloadError(
                f"non-canonical format version {version} for {name} of {ndim} dims; "
                f"it is written as version {canonical}"
            )
        pos += 4 * ndim
        (fp_len,) = _U8.unpack_from(data, pos)
        pos += 1
        if not 1 <= fp_len <= MAX_FINGERPRINT_BYTES:
            raise PayloadError(f"bad fingerprint length {fp_len}; expected 1..{MAX_FINGERPRINT_BYTES}")
        _, tdtype, np_dtype = _DTYPES[name]
        values_at = pos + fp_len
        total = values_at + _tensor_section_bytes(name, shape) + 4
        need(total, f"shape {shape} of {name}")
        if n > total:
            raise PayloadError(f"{n - total} trailing bytes after a payload of {total} bytes (shape {shape} of {name})")
        (crc,) = _U32.unpack_from(data, total - 4)
        if zlib.crc32(data[: total - 4]) != crc:
            raise PayloadError("CRC mismatch: the payload is corrupted")
        try:
            fingerprint = bytes(data[pos:values_at]).decode("utf-8")
        except UnicodeDecodeError:
            raise PayloadError("LM fingerprint is not valid utf-8") from None
        scale = None
        if name in _QUANTISED:
            rows = numel // shape[-1]
            scale = torch.from_numpy(_read_array(data, _SCALE_NP, rows, values_at)).reshape(shape[:-1])
            values_at += _SCALE_NP.itemsize * rows
            if not bool(torch.isfinite(scale).all()):
                raise PayloadError("payload has non-finite int8 scales (NaN or infinity)")
            if bool((scale < 0).any()):
                raise PayloadError("payload has a negative int8 scale")
        latent = torch.from_numpy(_read_array(data, np_dtype, numel, values_at)).reshape(shape)
        if tdtype == torch.bfloat16:
            latent = latent.view(torch.bfloat16)
        if not bool(torch.isfinite(latent).all()):
            raise PayloadError("payload has non-finite values (NaN or infinity)")
        if name in _QUANTISED:
            if bool((latent == -_INT8_MAX - 1).any()):
                raise PayloadError("payload has an int8 value of -128, outside the symmetric range -127..127")
            if not bool(torch.isfinite(_dequantise(latent, scale)).all()):
                raise PayloadError("payload has int8 values that dequantise to non-finite values (q x scale overflows)")
        if expected_fingerprint is not None and fingerprint != expected_fingerprint:
            raise PayloadError(
                f"payload was made by LM {fingerprint}, this receiver runs {expected_fingerprint}"
            )
        try:
            latent = latent.to(device)
            if scale is not None:
                scale = scale.to(device)
        except (RuntimeError, ValueError, TypeError) as e:
            raise PayloadError(f"cannot place the latent on device {device!r}: {e}") from None
        return cls(latent=latent, dtype=name, latent_dim=shape[-1], lm_fingerprint=fingerprint, scale=scale)


def wire_length(payload: TransportPayload) -> int:
    """Bytes on the wire: ``len(payload.to_bytes())`` (header + `byte_length()` + 4 CRC bytes)."""
    return len(payload.to_bytes())


def pack(
    z: torch.Tensor,
    *,
    lm_fingerprint: str,
    dtype: str | torch.dtype = "float32",
    staging_device: str | torch.device = "cpu",
) -> TransportPayload:
    """Stage a latent z for the handoff: (Z,), (B, Z), (N, Z) or (B, N, Z).

    The payload holds its own copy: detached (the handoff is a gradient boundary), cast to
    ``dtype`` (int8: quantised per row with a float32 scale, see the module docstring), on
    ``staging_device``, contiguous.

    Raises:
        ValueError: ``dtype`` is not one of float32/float16/bfloat16/int8; z is not a non-empty
            floating tensor of 1 to 3 dims; z has (or, after the cast, gets) non-finite values;
            the fingerprint is empty or over 64 utf-8 bytes.
    """
    name = _dtype_name(dtype)
    if not isinstance(z, torch.Tensor):
        raise ValueError(f"z must be a tensor, got {type(z).__name__}")
    if not z.is_floating_point():
        raise ValueError(f"z must be a floating tensor, got {z.dtype}")
    if not 1 <= z.dim() <= MAX_NDIM or z.numel() == 0:
        raise ValueError(f"z must be (Z,), (B, Z), (N, Z) or (B, N, Z), non-empty; got {tuple(z.shape)}")
    z = z.detach()
    if not bool(torch.isfinite(z).all()):
        raise ValueError("z has non-finite values (NaN or infinity)")
    if name in _QUANTISED:
        q, scale = _quantise_int8(z)
        return TransportPayload(
            latent=q.to(staging_device).contiguous(),
            dtype=name,
            latent_dim=int(q.shape[-1]),
            lm_fingerprint=lm_fingerprint,
            scale=scale.to(staging_device).contiguous(),
        )
    latent = z.to(device=staging_device, dtype=_DTYPES[name][1], copy=True).contiguous()
    if not bool(torch.isfinite(latent).all()):
        raise ValueError(f"z overflows {name}: its values are out of that dtype's range")
    return TransportPayload(latent=latent, dtype=name, latent_dim=int(latent.shape[-1]), lm_fingerprint=lm_fingerprint)


def unpack(
    payload: TransportPayload,
    device: str | torch.device,
    dtype: str | torch.dtype | None = None,
) -> torch.Tensor:
    """The receiver's own copy of z on ``device`` (never aliasing the payload or another receiver),
    optionally cast to a float ``dtype`` (e.g. float32 for the projector). Shape as in the payload.

    An int8 payload is dequantised, ``q * scale`` per row, to float32 (then cast to ``dtype`` if
    given).
    """
    if not isinstance(payload, TransportPayload):
        raise ValueError(f"expected a TransportPayload, got {type(payload).__name__}")
    tdtype = None
    if isinstance(dtype, torch.dtype):
        tdtype = dtype
    elif dtype is not None:
        tdtype = _DTYPES[_dtype_name(dtype)][1]
    if tdtype is not None and not tdtype.is_floating_point:
        raise ValueError(f"unpack dtype must be floating, got {dtype}")
    if payload.scale is None:
        return payload.latent.to(device=device, dtype=tdtype, copy=True)
    values = _dequantise(payload.latent, payload.scale, device)
    return values if tdtype is None or tdtype == torch.float32 else values.to(tdtype)


SEAL_MAGIC = b"ILCA"
SEAL_VERSIONS = (1, 2)
SEAL_VERSION = SEAL_VERSIONS[-1]  # the envelope `seal` writes
NONCE_BYTES = 16
_TAG_BYTES = 32
_SEAL_HEADER = struct.Struct("<4sB")  # magic, envelope version
_STAMP = struct.Struct(f"<{NONCE_BYTES}sQ")  # nonce, creation time in ms (version 2)


@dataclass(frozen=True)
class Envelope:
    """An authenticated envelope whose tag verified.

    Attributes:
        payload: the payload bytes inside (`TransportPayload.from_bytes` reads them).
        version: the envelope version, 1 or 2.
        nonce: 16 random bytes (version 2), None for version 1.
        created_at: the sender's clock when it sealed, seconds since the Unix epoch (version 2,
            to the millisecond), None for version 1.
    """

    payload: bytes
    version: int
    nonce: bytes | None = None
    created_at: float | None = None


def seal(wire: bytes, key: bytes, *, nonce: bytes | None = None, created_at: float | None = None) -> bytes:
    """Wrap payload bytes in the authenticated envelope (version 2, see the module docstring).

    Args:
        nonce: 16 bytes; default fresh random ones (give one only to test a receiver).
        created_at: seconds since the Unix epoch; default now.
    """
    nonce = os.urandom(NONCE_BYTES) if nonce is None else bytes(nonce)
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
    created_at = time.time() if created_at is None else created_at
    if not isinstance(created_at, (int, float)) or not 0 <= created_at < 2 ** 63 / 1000:
        raise ValueError(f"created_at must be seconds since the Unix epoch, got {created_at!r}")
    body = _SEAL_HEADER.pack(SEAL_MAGIC, SEAL_VERSION) + _STAMP.pack(nonce, round(created_at * 1000)) + bytes(wire)
    return body + hmac.new(check_key(key), body, hashlib.sha256).digest()


def is_sealed(data) -> bool:
    """Whether bytes-like `data` starts like an authenticated envelope (False for anything else)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return False
    try:
        return bytes(memoryview(data).cast("B")[:4]) == SEAL_MAGIC
    except (ValueError, TypeError, BufferError):
        return False


def open_envelope(data, key: bytes) -> Envelope:
    """The envelope around sealed bytes, after its tag verifies.

    Raises:
        PayloadError: not an envelope, an unknown envelope version, or a tag that does not
            verify (edited, truncated, or sealed with another key).
        ValueError: a key that is not bytes of length >= 16.
    """
    key = check_key(key)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise PayloadError(f"payload must be bytes-like, got {type(data).__name__}")
    try:
        data = bytes(memoryview(data).cast("B"))
    except (ValueError, TypeError, BufferError) as e:
        raise PayloadError(f"payload buffer is unreadable: {e}") from None
    if data[:4] != SEAL_MAGIC:
        raise PayloadError("payload is not authenticated, but this receiver requires a shared key")
    if len(data) < _SEAL_HEADER.size + _TAG_BYTES:
        raise PayloadError(f"authenticated payload truncated: {len(data)} bytes")
    version = data[4]
    if version not in SEAL_VERSIONS:
        raise PayloadError(f"unknown authenticated-payload version {version}; this receiver reads "
                           f"{list(SEAL_VERSIONS)}")
    stamp = _STAMP.size if version == 2 else 0
    if len(data) < _SEAL_HEADER.size + stamp + _TAG_BYTES:
        raise PayloadError(f"authenticated payload truncated: {len(data)} bytes")
    body, tag = data[:-_TAG_BYTES], data[-_TAG_BYTES:]
    if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), tag):
        raise PayloadError("authentication failed: the payload was changed or sealed with another key")
    if version == 1:
        return Envelope(payload=body[_SEAL_HEADER.size:], version=1)
    nonce, millis = _STAMP.unpack_from(body, _SEAL_HEADER.size)
    return Envelope(payload=body[_SEAL_HEADER.size + stamp:], version=2, nonce=nonce, created_at=millis / 1000)


def open_sealed(data, key: bytes) -> bytes:
    """The payload bytes inside an authenticated envelope, after the tag verifies (no replay
    check: see `ReplayGuard`). Raises as `open_envelope`."""
    return open_envelope(data, key).payload


class ReplayGuard:
    """A receiver's memory of the sealed payloads it accepted: each is accepted once.

    `check(envelope)` refuses (PayloadError) a version-1 envelope (it has no nonce), one created
    more than ``max_age`` seconds ago or more than ``max_skew`` seconds ahead of this clock, and
    one whose nonce it has seen; otherwise it records the nonce. Nonces are kept ``replay_window``
    seconds after their creation time (at least ``max_age``, so a replay is refused for as long as
    the original would be accepted), and at most ``max_nonces`` of them: when that many are held,
    the one created first is forgotten and from then on nothing created at or before it is
    accepted, so memory stays bounded without letting a replay through. Thread-safe; in memory
    only (a restarted receiver starts with an empty memory, protected by ``max_age`` alone).

    Args:
        max_age: seconds an envelope is accepted after its creation; None for no limit.
        replay_window: seconds a nonce is remembered; default ``max_age`` (None: until evicted).
        max_nonces: nonces remembered at most.
        max_skew: seconds a creation time may lie ahead of this receiver's clock.
        clock: seconds since the Unix epoch (`time.time`).
    """

    def __init__(self, max_age: float | None = 300.0, replay_window: float | None = None, *,
                 max_nonces: int = 65536, max_skew: float = 60.0, clock: Callable[[], float] = time.time):
        for name, value in (("max_age", max_age), ("replay_window", replay_window), ("max_skew", max_skew)):
            if (value is not None or name == "max_skew") and (
                    isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
        if replay_window is None:
            replay_window = max_age
        elif max_age is None or replay_window < max_age:
            raise ValueError(f"replay_window ({replay_window} s) must be at least max_age ({max_age} s): a replay "
                             "arriving after its nonce is forgotten would be accepted")
        self.max_age, self.replay_window, self.max_skew = max_age, replay_window, max_skew
        self.max_nonces = positive_int("max_nonces", max_nonces)
        self._clock = clock
        self._seen: set[bytes] = set()
        self._by_time: list[tuple[float, bytes]] = []  # heap of (created_at, nonce)
        self._floor = -math.inf  # created_at of the latest nonce forgotten to bound memory
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, envelope: Envelope) -> None:
        """Refuse a replayed, too old, future-dated or version-1 envelope; record its nonce."""
        if envelope.nonce is None or envelope.created_at is None:
            raise PayloadError(f"sealed payload of envelope version {envelope.version} carries no nonce or creation "
                               f"time, so a replay cannot be told apart: seal it with envelope version {SEAL_VERSION}")
        created = envelope.created_at
        with self._lock:
            now = self._clock()
            if created > now + self.max_skew:
                raise PayloadError(f"sealed payload is dated {created - now:.1f} s ahead of this receiver's clock "
                                   f"(max_skew {self.max_skew:g} s): check the sender's clock")
            if self.max_age is not None and created < now - self.max_age:
                raise PayloadError(f"sealed payload is {now - created:.1f} s old, older than this receiver's max_age "
                                   f"of {self.max_age:g} s: seal it again")
            if self.replay_window is not None:
                while self._by_time and self._by_time[0][0] < now - self.replay_window:
                    self._seen.discard(heapq.heappop(self._by_time)[1])
            if envelope.nonce in self._seen:
                raise PayloadError("replayed payload: this receiver has accepted these sealed bytes before "
                                   f"(nonce {envelope.nonce.hex()})")
            if created <= self._floor:
                raise PayloadError(f"sealed payload is older than the {self.max_nonces} payloads this receiver "
                                   "remembers, so a replay cannot be ruled out: seal it again")
            self._seen.add(envelope.nonce)
            heapq.heappush(self._by_time, (created, envelope.nonce))
            while len(self._seen) > self.max_nonces:
                oldest, nonce = heapq.heappop(self._by_time)
                self._seen.discard(nonce)
                self._floor = max(self._floor, oldest)
