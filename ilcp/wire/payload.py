"""The handoff payload: a latent tensor, packed at the gradient boundary and sent as bytes.

`pack(z, lm_fingerprint=...)` detaches the sender's latent z, casts (or quantises) it to the
payload dtype and stages it; `TransportPayload.to_bytes()` serialises it. The receiver reads bytes
in one pass: `opened(data, key=...)` unseals them and reads the header, the receiver checks the
declared shape, `WireHeader.read` verifies the rest (`TransportPayload.from_bytes` does all three),
and `unpack(payload, device)` gives its own copy of z. Sizes: ``payload.byte_length()`` is the
tensor bytes (128 for 32 x float32, the article's figure; 36 for int8 with its scale),
``wire_length(payload) == len(payload.to_bytes())`` the bytes on the wire.

Latent shapes: ``(Z,)`` one latent; ``(B, Z)`` a batch of one latent per context, or ``(N, Z)``
one context carried by N latents (one per chunk or sentence); ``(B, N, Z)`` a batch of those.
The payload keeps the shape and nothing else: whether a 2-D latent is (B, Z) or (N, Z) is the
caller's contract. ``latent_dim`` is always the last dimension.

Payload dtypes and int8 quantisation: `ilcp.wire.dtypes`. The authenticated envelope around
these bytes, and the replay guard: `ilcp.wire.seal`.

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

import math
import struct
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import positive_int
from .dtypes import (CODES, DTYPE_TABLE, DTYPES, INT8_MAX, QUANTISED, SCALE_NP, TORCH_NAMES, dequantise, dtype_name,
                     quantise_int8)
from .errors import PayloadError
from .seal import ReplayGuard, seal, unseal

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "DTYPES",
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "MAGIC",
    "MAX_NDIM",
    "PayloadError",
    "TransportPayload",
    "WireHeader",
    "opened",
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

_PREFIX = struct.Struct("<4sBBI")  # magic, version, dtype code, ndim
_U32 = struct.Struct("<I")
_U8 = struct.Struct("<B")
_MAX_HEADER = _PREFIX.size + 4 * MAX_NDIM + 1 + MAX_FINGERPRINT_BYTES


def _check_fingerprint(fp) -> bytes:
    if not isinstance(fp, str) or not fp:
        raise ValueError(f"lm_fingerprint must be a non-empty str, got {fp!r}")
    raw = fp.encode("utf-8")
    if len(raw) > MAX_FINGERPRINT_BYTES:
        raise ValueError(f"lm_fingerprint is {len(raw)} bytes in utf-8; at most {MAX_FINGERPRINT_BYTES}")
    return raw


def _format_version(name: str, ndim: int) -> int:
    """The lowest format version that expresses a payload of this dtype and rank."""
    return 1 if name not in QUANTISED and ndim <= _MAX_NDIM_BY_VERSION[1] else 2


def _tensor_section_bytes(name: str, shape: tuple[int, ...]) -> int:
    numel = math.prod(shape)
    if name in QUANTISED:
        return SCALE_NP.itemsize * (numel // shape[-1]) + numel
    return numel * DTYPE_TABLE[name][2].itemsize


def _max_wire_bytes(max_elements: int) -> int:
    """An upper bound on the wire size of any payload of at most `max_elements` latent values:
    the longest header, then per value the wider of a float32 and (int8 with latent_dim 1) one
    int8 byte plus its float32 scale, then the CRC."""
    return _MAX_HEADER + max_elements * max(DTYPE_TABLE["float32"][2].itemsize, 1 + SCALE_NP.itemsize) + 4


def _read_array(view: memoryview, np_dtype: np.dtype, count: int, offset: int) -> np.ndarray:
    """A native-order copy of `count` values at `offset`; keeps no reference to `view`."""
    return np.frombuffer(view, dtype=np_dtype, count=count, offset=offset).astype(np_dtype.newbyteorder("="))


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
        if not isinstance(self.dtype, str) or dtype_name(self.dtype) != TORCH_NAMES.get(t.dtype):
            raise ValueError(f"dtype {self.dtype!r} does not match the latent's dtype {t.dtype}")
        if not 1 <= t.dim() <= MAX_NDIM or t.numel() == 0:
            raise ValueError(
                f"latent must be (latent_dim,), (batch, latent_dim), (N, latent_dim) or (batch, N, latent_dim), "
                f"non-empty; got {tuple(t.shape)}"
            )
        if self.latent_dim != t.shape[-1]:
            raise ValueError(f"latent_dim {self.latent_dim} does not match the latent's shape {tuple(t.shape)}")
        if self.dtype in QUANTISED:
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
        code, _, np_dtype = DTYPE_TABLE[self.dtype]
        fp = _check_fingerprint(self.lm_fingerprint)
        scales = b""
        if self.dtype in QUANTISED:
            s = self.scale.detach().to("cpu").contiguous()
            if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
                raise ValueError("int8 scales must be finite and >= 0; refusing to serialise them")
            if bool((t == -INT8_MAX - 1).any()):
                raise ValueError("int8 latent holds -128, outside the symmetric range -127..127")
            if not bool(torch.isfinite(dequantise(t, s)).all()):
                raise ValueError("int8 latent dequantises to non-finite values; refusing to serialise it")
            scales = s.numpy().astype(SCALE_NP, copy=False).tobytes()
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
        """Parse and verify wire bytes (bytes, bytearray or memoryview) of either format version:
        `opened`, then `WireHeader.read`.

        Args:
            data: the bytes from `to_bytes`.
            expected_fingerprint: the receiver's LM fingerprint (None: not checked).
            device: where the latent (and an int8 payload's scales) are placed.
            max_elements: the most latent values accepted, checked from the header.
            key, guard: the shared key of sealed payloads and the receiver's replay guard
                (`opened`); unsealed bytes are refused with a key, sealed ones without.
            check_shape: the caller's rules for the declared shape, called before anything
                proportional to it is read; raises PayloadError to refuse.

        Raises:
            PayloadError: with the reason, for any input that is not a valid payload.
            ValueError: ``max_elements`` is not a positive int.
        """
        with opened(data, max_elements=max_elements, key=key, guard=guard) as header:
            if check_shape is not None:
                check_shape(header.shape)
            return header.read(expected_fingerprint=expected_fingerprint, device=device)


@dataclass(frozen=True)
class WireHeader:
    """A payload's header, read and bounded, over the flat bytes it came in (valid inside `opened`).

    Attributes:
        shape: the latent's declared shape, every dimension >= 1 (nothing proportional to it
            has been read yet).
        dtype: the payload dtype name.
        version: the format version.
        max_elements: the size limit `read` checks the shape against.
    """

    view: memoryview
    version: int
    dtype: str
    shape: tuple[int, ...]
    max_elements: int

    def read(self, *, expected_fingerprint: str | None = None, device: str | torch.device = "cpu") -> TransportPayload:
        """The payload: size limit, canonical version, fingerprint, CRC, scales and values checked.

        Raises:
            PayloadError: with the reason, for anything that is not a valid payload.
        """
        data, shape, name, version = self.view, self.shape, self.dtype, self.version
        n = data.nbytes
        numel = math.prod(shape)
        if numel > self.max_elements:
            raise PayloadError(
                f"payload declares shape {shape} ({numel} values), over the limit of max_elements={self.max_elements}"
            )
        canonical = _format_version(name, len(shape))
        if version != canonical:
            raise PayloadError(
                f"non-canonical format version {version} for {name} of {len(shape)} dims; "
                f"it is written as version {canonical}"
            )
        pos = _PREFIX.size + 4 * len(shape)
        (fp_len,) = _U8.unpack_from(data, pos)
        pos += 1
        if not 1 <= fp_len <= MAX_FINGERPRINT_BYTES:
            raise PayloadError(f"bad fingerprint length {fp_len}; expected 1..{MAX_FINGERPRINT_BYTES}")
        _, tdtype, np_dtype = DTYPE_TABLE[name]
        values_at = pos + fp_len
        total = values_at + _tensor_section_bytes(name, shape) + 4
        _need(n, total, f"shape {shape} of {name}")
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
        if name in QUANTISED:
            rows = numel // shape[-1]
            scale = torch.from_numpy(_read_array(data, SCALE_NP, rows, values_at)).reshape(shape[:-1])
            values_at += SCALE_NP.itemsize * rows
            if not bool(torch.isfinite(scale).all()):
                raise PayloadError("payload has non-finite int8 scales (NaN or infinity)")
            if bool((scale < 0).any()):
                raise PayloadError("payload has a negative int8 scale")
        latent = torch.from_numpy(_read_array(data, np_dtype, numel, values_at)).reshape(shape)
        if tdtype == torch.bfloat16:
            latent = latent.view(torch.bfloat16)
        if not bool(torch.isfinite(latent).all()):
            raise PayloadError("payload has non-finite values (NaN or infinity)")
        if name in QUANTISED:
            if bool((latent == -INT8_MAX - 1).any()):
                raise PayloadError("payload has an int8 value of -128, outside the symmetric range -127..127")
            if not bool(torch.isfinite(dequantise(latent, scale)).all()):
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
        return TransportPayload(latent=latent, dtype=name, latent_dim=shape[-1], lm_fingerprint=fingerprint,
                                scale=scale)


def _need(n: int, end: int, what: str) -> None:
    if n < end:
        raise PayloadError(f"truncated payload: {n} bytes, the {what} needs at least {end}")


def _read_header(data: memoryview, max_elements: int) -> WireHeader:
    """The header of a flat byte view, up to the shape; copies nothing."""
    n = data.nbytes
    _need(n, _PREFIX.size, "header")
    magic, version, code, ndim = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {bytes(magic)!r}: not an ILCP payload (expected {MAGIC!r})")
    if version not in FORMAT_VERSIONS:
        raise PayloadError(
            f"unknown payload format version {version}; this receiver reads versions {list(FORMAT_VERSIONS)}"
        )
    if code not in CODES:
        raise PayloadError(f"unknown dtype code {code}; known codes: {CODES}")
    max_ndim = _MAX_NDIM_BY_VERSION[version]
    if not 1 <= ndim <= max_ndim:
        raise PayloadError(f"bad shape: ndim {ndim}; format version {version} carries 1 to {max_ndim} dims")
    pos = _PREFIX.size
    _need(n, pos + 4 * ndim + 1, "shape")
    shape = tuple(_U32.unpack_from(data, pos + 4 * i)[0] for i in range(ndim))
    if min(shape) == 0:
        raise PayloadError(f"bad shape {shape}: empty dimension")
    return WireHeader(view=data, version=version, dtype=CODES[code], shape=shape, max_elements=max_elements)


@contextmanager
def opened(data, *, max_elements: int = DEFAULT_MAX_ELEMENTS, key: bytes | None = None,
           guard: ReplayGuard | None = None, limit: str | None = None) -> Iterator[WireHeader]:
    """What arrived, opened (unsealed with ``key``, `ilcp.wire.seal.unseal`) and its header read:
    ``with opened(data, key=k) as header: check(header.shape); payload = header.read()``. The
    caller checks the declared shape before anything proportional to it is read; the buffer is
    read in place and released on leaving the block. ``limit``: what ``max_elements`` stands for,
    with the fix, in the refusal of sealed bytes longer than any payload within it.

    Raises:
        PayloadError: what `unseal` refuses; not bytes-like; a header that does not read.
        ValueError: ``max_elements`` is not a positive int.
    """
    positive_int("max_elements", max_elements)
    limit = limit or f"that max_elements={max_elements} latent values can take: raise max_elements to read it"
    data = unseal(data, key=key, guard=guard, max_bytes=_max_wire_bytes(max_elements) + 64, limit=limit)
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
            yield _read_header(view, max_elements)


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
    name = dtype_name(dtype)
    if not isinstance(z, torch.Tensor):
        raise ValueError(f"z must be a tensor, got {type(z).__name__}")
    if not z.is_floating_point():
        raise ValueError(f"z must be a floating tensor, got {z.dtype}")
    if not 1 <= z.dim() <= MAX_NDIM or z.numel() == 0:
        raise ValueError(f"z must be (Z,), (B, Z), (N, Z) or (B, N, Z), non-empty; got {tuple(z.shape)}")
    z = z.detach()
    if not bool(torch.isfinite(z).all()):
        raise ValueError("z has non-finite values (NaN or infinity)")
    if name in QUANTISED:
        q, scale = quantise_int8(z)
        return TransportPayload(
            latent=q.to(staging_device).contiguous(),
            dtype=name,
            latent_dim=int(q.shape[-1]),
            lm_fingerprint=lm_fingerprint,
            scale=scale.to(staging_device).contiguous(),
        )
    latent = z.to(device=staging_device, dtype=DTYPE_TABLE[name][1], copy=True).contiguous()
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
        tdtype = DTYPE_TABLE[dtype_name(dtype)][1]
    if tdtype is not None and not tdtype.is_floating_point:
        raise ValueError(f"unpack dtype must be floating, got {dtype}")
    if payload.scale is None:
        return payload.latent.to(device=device, dtype=tdtype, copy=True)
    values = dequantise(payload.latent, payload.scale, device)
    return values if tdtype is None or tdtype == torch.float32 else values.to(tdtype)
