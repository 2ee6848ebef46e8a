"""The handoff payload: a latent tensor, packed at the gradient boundary and sent as bytes.

`pack(z, lm_fingerprint=...)` detaches the sender's latent z (B, latent_dim), casts it to the
payload dtype and stages it; `TransportPayload.to_bytes()` serialises it; the receiver calls
`TransportPayload.from_bytes(data, expected_fingerprint=...)`, which verifies everything, and
`unpack(payload, device)` for its own copy of z. In-process handoffs skip the bytes; a network
transport (gRPC, a shared-memory ring) sends them without touching call sites.

Two sizes, both reported by evaluation:
- ``payload.byte_length()``: the tensor bytes, numel x element_size of the real tensor (the
  article's payload figure: 32 x float32 = 128 bytes).
- ``wire_length(payload) == len(payload.to_bytes())``: the bytes on the wire, header and CRC
  included (``header_length + byte_length() + 4``).

Wire format, version 1 (all integers little-endian, ``struct`` format ``'<'``):

| offset      | size          | field                                                         |
|-------------|---------------|---------------------------------------------------------------|
| 0           | 4             | magic ``b"ILCP"``                                             |
| 4           | 1             | format version, uint8 = 1                                     |
| 5           | 1             | dtype code, uint8: 1 float32, 2 float16, 3 bfloat16           |
| 6           | 4             | ndim, uint32: 1 (latent_dim,) or 2 (batch, latent_dim)        |
| 10          | 4 x ndim      | shape, uint32 each, every dimension >= 1                      |
| 10 + 4n     | 1             | fingerprint length F, uint8, 1..64                            |
| 11 + 4n     | F             | LM fingerprint, utf-8                                         |
| 11 + 4n + F | numel x size  | tensor values, row-major, little-endian (bfloat16 as its raw  |
|             |               | 16 bits)                                                      |
| end - 4     | 4             | CRC32 (zlib) of every byte before it, uint32                  |

`from_bytes` raises `PayloadError` (a ValueError) with the reason for anything that is not a
valid payload: not bytes-like, truncated, bad magic, unknown version, unknown dtype code, bad
shape, trailing bytes, CRC mismatch, non-finite values, or a fingerprint that differs from the
receiver's LM. It raises nothing else for any input. CRC32 detects every error of up to four
flipped bits in payloads of this size, and any burst of up to 32 bits.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "PayloadError",
    "TransportPayload",
    "pack",
    "unpack",
    "wire_length",
]

MAGIC = b"ILCP"
FORMAT_VERSION = 1
MAX_FINGERPRINT_BYTES = 64

# name -> (dtype code, torch dtype, little-endian numpy dtype of the raw values)
_DTYPES = {
    "float32": (1, torch.float32, np.dtype("<f4")),
    "float16": (2, torch.float16, np.dtype("<f2")),
    "bfloat16": (3, torch.bfloat16, np.dtype("<i2")),
}
_CODES = {code: name for name, (code, _, _) in _DTYPES.items()}
_TORCH_NAMES = {tdtype: name for name, (_, tdtype, _) in _DTYPES.items()}

_PREFIX = struct.Struct("<4sBBI")  # magic, version, dtype code, ndim
_U32 = struct.Struct("<I")
_U8 = struct.Struct("<B")


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


@dataclass(frozen=True)
class TransportPayload:
    """A latent ready to cross the handoff.

    Attributes:
        latent: z, shaped (batch, latent_dim), or (latent_dim,) for a single latent; detached,
            contiguous, in the payload dtype.
        dtype: the payload dtype name: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        latent_dim: ``latent.shape[-1]``.
        lm_fingerprint: fingerprint of the LM whose pooled states produced z (`ilcp.lm`).

    Build payloads with `pack`; the constructor checks that the fields agree (ValueError).
    """

    latent: torch.Tensor
    dtype: str
    latent_dim: int
    lm_fingerprint: str

    def __post_init__(self):
        t = self.latent
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"latent must be a tensor, got {type(t).__name__}")
        if not isinstance(self.dtype, str) or _dtype_name(self.dtype) != _TORCH_NAMES.get(t.dtype):
            raise ValueError(f"dtype {self.dtype!r} does not match the latent's dtype {t.dtype}")
        if t.dim() not in (1, 2) or t.numel() == 0:
            raise ValueError(f"latent must be (batch, latent_dim) or (latent_dim,), non-empty; got {tuple(t.shape)}")
        if self.latent_dim != t.shape[-1]:
            raise ValueError(f"latent_dim {self.latent_dim} does not match the latent's shape {tuple(t.shape)}")
        _check_fingerprint(self.lm_fingerprint)

    def byte_length(self) -> int:
        """Tensor bytes: numel x element_size of the real tensor (128 for 32 x float32)."""
        return self.latent.numel() * self.latent.element_size()

    def to_bytes(self) -> bytes:
        """The wire format described in the module docstring.

        Raises:
            ValueError: the latent has NaN or infinite values (no receiver would accept them).
        """
        t = self.latent.detach().to("cpu").contiguous()
        if not bool(torch.isfinite(t).all()):
            raise ValueError("latent has non-finite values; refusing to serialise it")
        code, _, np_dtype = _DTYPES[self.dtype]
        fp = _check_fingerprint(self.lm_fingerprint)
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        values = t.numpy().astype(np_dtype, copy=False).tobytes()
        body = b"".join([
            _PREFIX.pack(MAGIC, FORMAT_VERSION, code, t.dim()),
            b"".join(_U32.pack(d) for d in t.shape),
            _U8.pack(len(fp)),
            fp,
            values,
        ])
        return body + _U32.pack(zlib.crc32(body))

    @classmethod
    def from_bytes(
        cls,
        data,
        *,
        expected_fingerprint: str | None = None,
        device: str | torch.device = "cpu",
    ) -> TransportPayload:
        """Parse and verify wire bytes (bytes, bytearray or memoryview).

        Args:
            data: the bytes from `to_bytes`.
            expected_fingerprint: the receiver's LM fingerprint; a payload made by another LM is
                refused. None skips that check.
            device: where the latent is placed.

        Raises:
            PayloadError: with the reason, for any input that is not a valid payload.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise PayloadError(f"payload must be bytes-like, got {type(data).__name__}")
        try:
            data = bytes(data)
        except (ValueError, TypeError, BufferError) as e:
            raise PayloadError(f"payload buffer is unreadable: {e}") from None
        n = len(data)

        def need(end: int, what: str) -> None:
            if n < end:
                raise PayloadError(f"truncated payload: {n} bytes, the {what} needs at least {end}")

        need(_PREFIX.size, "header")
        magic, version, code, ndim = _PREFIX.unpack_from(data, 0)
        if magic != MAGIC:
            raise PayloadError(f"bad magic {magic!r}: not an ILCP payload (expected {MAGIC!r})")
        if version != FORMAT_VERSION:
            raise PayloadError(
                f"unknown payload format version {version}; this receiver reads version {FORMAT_VERSION}"
            )
        if code not in _CODES:
            raise PayloadError(f"unknown dtype code {code}; known codes: {_CODES}")
        if ndim not in (1, 2):
            raise PayloadError(f"bad shape: ndim {ndim}, expected 1 or 2")
        pos = _PREFIX.size
        need(pos + 4 * ndim + 1, "shape")
        shape = tuple(_U32.unpack_from(data, pos + 4 * i)[0] for i in range(ndim))
        if min(shape) == 0:
            raise PayloadError(f"bad shape {shape}: empty dimension")
        pos += 4 * ndim
        (fp_len,) = _U8.unpack_from(data, pos)
        pos += 1
        if not 1 <= fp_len <= MAX_FINGERPRINT_BYTES:
            raise PayloadError(f"bad fingerprint length {fp_len}; expected 1..{MAX_FINGERPRINT_BYTES}")
        name = _CODES[code]
        _, tdtype, np_dtype = _DTYPES[name]
        numel = 1
        for d in shape:
            numel *= d
        values_at = pos + fp_len
        total = values_at + numel * np_dtype.itemsize + 4
        need(total, f"shape {shape} of {name}")
        if n > total:
            raise PayloadError(f"{n - total} trailing bytes after a payload of {total} bytes (shape {shape} of {name})")
        (crc,) = _U32.unpack_from(data, total - 4)
        if zlib.crc32(data[: total - 4]) != crc:
            raise PayloadError("CRC mismatch: the payload is corrupted")
        try:
            fingerprint = data[pos:values_at].decode("utf-8")
        except UnicodeDecodeError:
            raise PayloadError("LM fingerprint is not valid utf-8") from None
        values = np.frombuffer(data, dtype=np_dtype, count=numel, offset=values_at)
        latent = torch.from_numpy(values.astype(np_dtype.newbyteorder("="))).reshape(shape)
        if tdtype == torch.bfloat16:
            latent = latent.view(torch.bfloat16)
        if not bool(torch.isfinite(latent).all()):
            raise PayloadError("payload has non-finite values (NaN or infinity)")
        if expected_fingerprint is not None and fingerprint != expected_fingerprint:
            raise PayloadError(
                f"payload was made by LM {fingerprint}, this receiver runs {expected_fingerprint}"
            )
        try:
            latent = latent.to(device)
        except (RuntimeError, ValueError, TypeError) as e:
            raise PayloadError(f"cannot place the latent on device {device!r}: {e}") from None
        return cls(latent=latent, dtype=name, latent_dim=shape[-1], lm_fingerprint=fingerprint)


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
    """Stage a latent z (B, latent_dim) or (latent_dim,) for the handoff.

    The payload holds its own copy: detached (the handoff is a gradient boundary), cast to
    ``dtype``, on ``staging_device``, contiguous.

    Raises:
        ValueError: ``dtype`` is not float32/float16/bfloat16; z is not a non-empty rank-1 or
            rank-2 floating tensor; z has (or, after the cast, gets) non-finite values; the
            fingerprint is empty or over 64 utf-8 bytes.
    """
    name = _dtype_name(dtype)
    if not isinstance(z, torch.Tensor):
        raise ValueError(f"z must be a tensor, got {type(z).__name__}")
    if not z.is_floating_point():
        raise ValueError(f"z must be a floating tensor, got {z.dtype}")
    if z.dim() not in (1, 2) or z.numel() == 0:
        raise ValueError(f"z must be (batch, latent_dim) or (latent_dim,), non-empty; got {tuple(z.shape)}")
    z = z.detach()
    if not bool(torch.isfinite(z).all()):
        raise ValueError("z has non-finite values (NaN or infinity)")
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
    optionally cast to ``dtype`` (e.g. float32 for the projector). Shape as in the payload."""
    if not isinstance(payload, TransportPayload):
        raise ValueError(f"expected a TransportPayload, got {type(payload).__name__}")
    tdtype = None
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"unpack dtype must be floating, got {dtype}")
        tdtype = dtype
    elif dtype is not None:
        tdtype = _DTYPES[_dtype_name(dtype)][1]
    return payload.latent.to(device=device, dtype=tdtype, copy=True)
