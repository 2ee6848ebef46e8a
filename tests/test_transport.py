"""TransportPayload, pack/unpack and the wire format (ilcp.transport)."""

import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ilcp.transport import (
    FORMAT_VERSION,
    MAGIC,
    PayloadError,
    TransportPayload,
    pack,
    unpack,
    wire_length,
)

FP = "b6ea7d5cd9274032"


def header_length(ndim: int, fingerprint: str = FP) -> int:
    return 4 + 1 + 1 + 4 + 4 * ndim + 1 + len(fingerprint.encode())


def recrc(body_and_crc: bytes) -> bytes:
    """Replace the trailing CRC with a valid one for the bytes before it."""
    body = body_and_crc[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def z32(batch=1, seed=0):
    return torch.randn(batch, 32, generator=torch.Generator().manual_seed(seed))


VALID = pack(z32(), lm_fingerprint=FP).to_bytes()


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 32), (3, 8), (32,)])
def test_round_trip_exact(dtype, shape):
    z = torch.randn(shape) * 3
    p = pack(z, lm_fingerprint=FP, dtype=dtype)
    assert p.dtype == dtype and p.latent.dtype == getattr(torch, dtype)
    assert p.latent_dim == shape[-1]
    q = TransportPayload.from_bytes(p.to_bytes(), expected_fingerprint=FP)
    assert q.dtype == dtype and q.latent_dim == p.latent_dim and q.lm_fingerprint == FP
    assert q.latent.shape == p.latent.shape and q.latent.dtype == p.latent.dtype
    assert torch.equal(q.latent, p.latent)
    assert torch.equal(p.latent, z.to(getattr(torch, dtype)))


def test_sizes():
    p = pack(z32(), lm_fingerprint=FP)
    assert p.byte_length() == 128
    assert len(p.to_bytes()) == wire_length(p) == header_length(2) + 128 + 4
    assert pack(z32(), lm_fingerprint=FP, dtype="bfloat16").byte_length() == 64
    assert pack(z32(4), lm_fingerprint=FP, dtype="float16").byte_length() == 4 * 32 * 2
    single = pack(torch.zeros(32), lm_fingerprint=FP)
    assert single.byte_length() == 128 and wire_length(single) == header_length(1) + 128 + 4


def test_wire_layout_is_little_endian():
    z = torch.tensor([[1.0, -2.0]])
    b = pack(z, lm_fingerprint="ab").to_bytes()
    assert b[:4] == MAGIC and b[4] == FORMAT_VERSION and b[5] == 1
    assert struct.unpack_from("<III", b, 6) == (2, 1, 2)
    assert b[18] == 2 and b[19:21] == b"ab"
    assert b[21:29] == struct.pack("<2f", 1.0, -2.0)
    assert struct.unpack("<I", b[-4:])[0] == zlib.crc32(b[:-4])


def test_pack_detaches_and_copies():
    z = z32().requires_grad_(True)
    p = pack(z * 2, lm_fingerprint=FP)
    assert not p.latent.requires_grad and p.latent.grad_fn is None
    plain = z32()
    p = pack(plain, lm_fingerprint=FP)
    plain.add_(1.0)
    assert torch.equal(p.latent, z32())  # the sender's later edits do not reach the payload
    assert p.latent.is_contiguous() and p.latent.device.type == "cpu"
    assert pack(z32().t(), lm_fingerprint=FP).latent.is_contiguous()


def test_unpack_clones():
    p = pack(z32(), lm_fingerprint=FP)
    a, b = unpack(p, "cpu"), unpack(p, "cpu")
    assert a.data_ptr() != b.data_ptr() != p.latent.data_ptr()
    a.mul_(0)
    assert torch.equal(b, z32()) and torch.equal(p.latent, z32())
    c = unpack(pack(z32(), lm_fingerprint=FP, dtype="bfloat16"), "cpu", dtype=torch.float32)
    assert c.dtype == torch.float32 and torch.equal(c, z32().bfloat16().float())
    assert unpack(p, "cpu", dtype="float16").dtype == torch.float16


@pytest.mark.parametrize(
    "kwargs, z",
    [
        ({"dtype": "int8"}, z32()),
        ({"dtype": torch.int32}, z32()),
        ({"dtype": "float64"}, z32()),
        ({}, torch.ones(1, 32, dtype=torch.long)),
        ({}, torch.tensor([[1.0, float("nan")]])),
        ({}, torch.tensor([[1.0, float("inf")]])),
        ({"dtype": "float16"}, torch.tensor([[1e6, 1.0]])),  # overflows float16
        ({}, torch.zeros(1, 2, 3)),
        ({}, torch.zeros(0, 32)),
        ({"lm_fingerprint": ""}, z32()),
        ({"lm_fingerprint": "x" * 65}, z32()),
    ],
)
def test_pack_rejects(kwargs, z):
    kwargs = {"lm_fingerprint": FP, **kwargs}
    with pytest.raises(ValueError):
        pack(z, **kwargs)


def test_payload_fields_must_agree():
    with pytest.raises(ValueError, match="latent_dim"):
        TransportPayload(torch.zeros(1, 32), "float32", 31, FP)
    with pytest.raises(ValueError, match="dtype"):
        TransportPayload(torch.zeros(1, 32), "float16", 32, FP)


# ---------------------------------------------------------------------------- each failure


def with_nan() -> bytes:
    b = bytearray(VALID)
    start = header_length(2)
    b[start:start + 4] = struct.pack("<f", float("nan"))
    return recrc(bytes(b))


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "truncated"),
        (VALID[:5], "truncated"),
        (VALID[:20], "truncated"),
        (VALID[:-1], "truncated"),
        (b"ILCQ" + VALID[4:], "bad magic"),
        (recrc(VALID[:4] + bytes([2]) + VALID[5:]), "unknown payload format version 2"),
        (recrc(VALID[:5] + bytes([9]) + VALID[6:]), "unknown dtype code 9"),
        (recrc(VALID[:6] + struct.pack("<I", 3) + VALID[10:]), "bad shape"),
        (recrc(VALID[:10] + struct.pack("<I", 0) + VALID[14:]), "bad shape"),
        (VALID + b"\x00", "trailing bytes"),
        (VALID[:-4] + bytes([VALID[-4] ^ 1]) + VALID[-3:], "CRC mismatch"),
        (VALID[:40] + bytes([VALID[40] ^ 0x80]) + VALID[41:], "CRC mismatch"),
        (with_nan(), "non-finite"),
        ("not bytes", "bytes-like"),
        (None, "bytes-like"),
        ([1, 2, 3], "bytes-like"),
    ],
)
def test_from_bytes_reasons(data, reason):
    with pytest.raises(PayloadError, match=reason):
        TransportPayload.from_bytes(data)


def test_fingerprint_mismatch():
    with pytest.raises(PayloadError, match=f"payload was made by LM {FP}, this receiver runs 0123456789abcdef"):
        TransportPayload.from_bytes(VALID, expected_fingerprint="0123456789abcdef")
    assert TransportPayload.from_bytes(VALID).lm_fingerprint == FP  # no expectation: no check


def test_bytes_like_inputs():
    for data in (bytearray(VALID), memoryview(VALID)):
        assert torch.equal(TransportPayload.from_bytes(data).latent, z32())


def test_payload_error_is_value_error():
    assert issubclass(PayloadError, ValueError)


def test_to_bytes_refuses_non_finite():
    p = TransportPayload(torch.tensor([[1.0, float("nan")]]), "float32", 2, FP)
    with pytest.raises(ValueError, match="non-finite"):
        p.to_bytes()


# ---------------------------------------------------------------------------- properties

PAYLOADS = [
    VALID,
    pack(z32(3, seed=1), lm_fingerprint=FP, dtype="float16").to_bytes(),
    pack(torch.randn(32), lm_fingerprint="fp-é", dtype="bfloat16").to_bytes(),
]
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(which=st.integers(0, len(PAYLOADS) - 1), data=st.data())
def test_any_truncation_raises_payload_error(which, data):
    b = PAYLOADS[which]
    n = data.draw(st.integers(0, len(b) - 1))
    with pytest.raises(PayloadError, match="truncated"):
        TransportPayload.from_bytes(b[:n])


@FAST
@given(which=st.integers(0, len(PAYLOADS) - 1), data=st.data())
def test_bit_flips_never_decode(which, data):
    # CRC32 detects every error of up to 4 flipped bits in messages this short (Hamming distance
    # 5 below about 2,900 bits), so any 1..4 distinct flips must be refused, whatever they hit.
    b = bytearray(PAYLOADS[which])
    bits = data.draw(st.sets(st.integers(0, 8 * len(b) - 1), min_size=1, max_size=4))
    for bit in bits:
        b[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(PayloadError):
        TransportPayload.from_bytes(bytes(b))


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_payload_error(data):
    with pytest.raises(PayloadError):
        TransportPayload.from_bytes(data)


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_after_valid_prefix_raise_only_payload_error(tail):
    # Past the magic and version, so the parser's later stages see arbitrary input too.
    with pytest.raises(PayloadError):
        TransportPayload.from_bytes(MAGIC + bytes([FORMAT_VERSION]) + tail)


@FAST
@given(st.binary(min_size=0, max_size=200))
def test_random_body_with_valid_crc_raises_only_payload_error(body):
    # A correct CRC over garbage: every later check must still turn it into a PayloadError.
    data = MAGIC + bytes([FORMAT_VERSION]) + body
    data += struct.pack("<I", zlib.crc32(data))
    try:
        p = TransportPayload.from_bytes(data)
    except PayloadError:
        return
    assert torch.isfinite(p.latent.float()).all()  # only a well-formed payload may decode
    assert p.to_bytes() == data
