"""TransportPayload, pack/unpack and the wire format (ilcp.wire.payload)."""

import math
import random
import struct
import tracemalloc
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ilcp.wire.payload import (
    DEFAULT_MAX_ELEMENTS,
    DTYPES,
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    MAGIC,
    PayloadError,
    TransportPayload,
    pack,
    unpack,
    wire_length,
)

FP = "b6ea7d5cd9274032"
FLOATS = ["float32", "float16", "bfloat16"]
# (Z,), (B, Z), (N, Z) per context, (B, N, Z) for a batch
SHAPES = [(32,), (1, 32), (3, 8), (5, 32), (2, 3, 8), (1, 4, 32)]


def header_length(ndim: int, fingerprint: str = FP) -> int:
    return 4 + 1 + 1 + 4 + 4 * ndim + 1 + len(fingerprint.encode())


def recrc(body_and_crc: bytes) -> bytes:
    """Replace the trailing CRC with a valid one for the bytes before it."""
    body = body_and_crc[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def z32(batch=1, seed=0):
    return torch.randn(batch, 32, generator=torch.Generator().manual_seed(seed))


def randn(shape, seed=0, std=3.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


def int8_error_bound(scale: torch.Tensor) -> torch.Tensor:
    """scale / 2 per row, plus float32 rounding of the dequantised product q * scale (|q| <= 127)."""
    return (scale * (0.5 + 127 * 2.0**-24)).unsqueeze(-1)


VALID = pack(z32(), lm_fingerprint=FP).to_bytes()
VALID_INT8 = pack(z32(), lm_fingerprint=FP, dtype="int8").to_bytes()

# Version-1 payloads written by the format's first release (checked in; they must parse to the
# same tensors forever, and the writer must still produce them byte for byte).
V1_SAMPLES = [
    (
        "494c4350010102000000010000000400000010623665613764356364393237343033320000c03f000010c000000000cdcccc3d3ec5030b",
        "float32", FP, torch.tensor([[1.5, -2.25, 0.0, 0.1]]),
    ),
    (
        "494c435001020100000003000000046c6d2d61003800c2ff7bd5bdbd0b",
        "float16", "lm-a", torch.tensor([0.5, -3.0, 65504.0]),
    ),
    (
        "494c43500103020000000200000002000000046c6d2d62803f00bf2040833a34923b70",
        "bfloat16", "lm-b", torch.tensor([[1.0, -0.5], [2.5, 1e-3]]),
    ),
]


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_exact(dtype, shape):
    z = torch.randn(shape) * 3
    p = pack(z, lm_fingerprint=FP, dtype=dtype)
    assert p.dtype == dtype and p.latent.dtype == getattr(torch, dtype) and p.scale is None
    assert p.latent_dim == shape[-1]
    assert p.format_version == (1 if len(shape) <= 2 else 2)
    b = p.to_bytes()
    assert b[4] == p.format_version
    q = TransportPayload.from_bytes(b, expected_fingerprint=FP)
    assert q.dtype == dtype and q.latent_dim == p.latent_dim and q.lm_fingerprint == FP
    assert q.latent.shape == p.latent.shape == shape and q.latent.dtype == p.latent.dtype
    assert torch.equal(q.latent, p.latent)
    assert torch.equal(p.latent, z.to(getattr(torch, dtype)))
    assert q.to_bytes() == b
    out = unpack(q, "cpu", dtype=torch.float32)
    assert out.shape == shape and torch.equal(out, z.to(getattr(torch, dtype)).float())


@pytest.mark.parametrize("shape", SHAPES + [(8, 64), (3, 1)])
def test_int8_round_trip(shape):
    # Rows of very different magnitudes: the scale is per row, not per tensor.
    z = randn(shape) * torch.logspace(-3, 3, math.prod(shape[:-1])).reshape(shape[:-1] + (1,))
    p = pack(z, lm_fingerprint=FP, dtype="int8")
    assert p.dtype == "int8" and p.latent.dtype == torch.int8 and p.latent.shape == shape
    assert p.scale.dtype == torch.float32 and p.scale.shape == shape[:-1]
    assert p.latent_dim == shape[-1] and p.format_version == 2
    # The scale is max|row| / 127 (rounded up to a float32) and the largest value maps to +-127.
    absmax = z.double().abs().amax(-1)
    assert torch.all(p.scale.double() >= absmax / 127)
    assert torch.all(p.scale.double() <= absmax / 127 * (1 + 2.0**-23))
    assert torch.all(p.latent.abs().amax(-1) == 127) and int(p.latent.min()) >= -127

    b = p.to_bytes()
    q = TransportPayload.from_bytes(b, expected_fingerprint=FP)
    assert q.dtype == "int8" and q.latent_dim == shape[-1] and q.lm_fingerprint == FP
    assert torch.equal(q.latent, p.latent) and torch.equal(q.scale, p.scale)
    assert q.to_bytes() == b and b[4] == 2 and b[5] == 4

    out = unpack(q, "cpu")
    assert out.dtype == torch.float32 and out.shape == shape
    assert torch.equal(out, unpack(p, "cpu"))
    assert torch.all((out - z).abs() <= int8_error_bound(p.scale))
    # Exactly within scale / 2 before the float32 product is rounded.
    exact = p.latent.double() * p.scale.double().unsqueeze(-1)
    assert torch.all((exact - z.double()).abs() <= p.scale.double().unsqueeze(-1) * (0.5 + 1e-12))


def test_int8_zero_rows():
    z = randn((4, 16))
    z[1] = 0.0
    z[3] = -0.0
    p = pack(z, lm_fingerprint=FP, dtype="int8")
    assert p.scale[1] == 0 and p.scale[3] == 0 and p.scale[0] > 0
    assert not p.latent[1].any() and not p.latent[3].any()
    out = unpack(TransportPayload.from_bytes(p.to_bytes()), "cpu")
    assert torch.equal(out[1], torch.zeros(16)) and torch.equal(out[3], torch.zeros(16))
    assert torch.all((out - z).abs() <= int8_error_bound(p.scale))
    for zeros in (torch.zeros(32), torch.zeros(2, 3, 8)):
        p = pack(zeros, lm_fingerprint=FP, dtype="int8")
        assert not p.scale.any() and not p.latent.any()
        assert torch.equal(unpack(TransportPayload.from_bytes(p.to_bytes()), "cpu"), zeros)


@pytest.mark.parametrize(
    "row",
    [
        torch.tensor([1e-40, -3e-41, 0.0], dtype=torch.float32),  # float32 subnormals
        torch.tensor([1e-300, -1e-301], dtype=torch.float64),  # below float32's range
        torch.tensor([3e38, -1.0, 1e-3], dtype=torch.float32),  # near float32's maximum
        torch.tensor([-7.25], dtype=torch.float64),  # latent_dim 1
        torch.tensor([127.0, -127.0, 0.5, -0.5, 1.5], dtype=torch.float32),  # ties at half a step
    ],
)
def test_int8_extreme_rows(row):
    p = pack(row, lm_fingerprint=FP, dtype="int8")
    assert p.scale.shape == () and torch.isfinite(p.scale)
    out = unpack(TransportPayload.from_bytes(p.to_bytes()), "cpu", dtype=torch.float64)
    assert torch.all((out - row.double()).abs() <= int8_error_bound(p.scale.double()))


def test_int8_accepts_torch_dtype_and_any_float_input():
    z = randn((2, 8)).double()
    a = pack(z, lm_fingerprint=FP, dtype=torch.int8)
    b = pack(z.float(), lm_fingerprint=FP, dtype="int8")
    assert a.dtype == "int8" and a.to_bytes() == b.to_bytes()
    c = pack(z.bfloat16(), lm_fingerprint=FP, dtype="int8")
    assert torch.all((unpack(c, "cpu") - z.bfloat16().float()).abs() <= int8_error_bound(c.scale))


def test_sizes():
    p = pack(z32(), lm_fingerprint=FP)
    assert p.byte_length() == 128
    assert len(p.to_bytes()) == wire_length(p) == header_length(2) + 128 + 4
    assert pack(z32(), lm_fingerprint=FP, dtype="bfloat16").byte_length() == 64
    assert pack(z32(4), lm_fingerprint=FP, dtype="float16").byte_length() == 4 * 32 * 2
    single = pack(torch.zeros(32), lm_fingerprint=FP)
    assert single.byte_length() == 128 and wire_length(single) == header_length(1) + 128 + 4
    multi = pack(torch.zeros(2, 3, 8), lm_fingerprint=FP, dtype="float16")
    assert multi.byte_length() == 48 * 2 and wire_length(multi) == header_length(3) + 96 + 4


@pytest.mark.parametrize(
    "shape, tensor_bytes",
    [((32,), 32 + 4), ((1, 32), 32 + 4), ((8, 64), 8 * 64 + 8 * 4), ((2, 3, 8), 48 + 6 * 4)],
)
def test_int8_sizes(shape, tensor_bytes):
    # byte_length counts what is carried: the int8 values and one float32 scale per row.
    p = pack(randn(shape), lm_fingerprint=FP, dtype="int8")
    assert p.byte_length() == tensor_bytes
    assert len(p.to_bytes()) == wire_length(p) == header_length(len(shape)) + tensor_bytes + 4


def test_wire_layout_is_little_endian():
    z = torch.tensor([[1.0, -2.0]])
    b = pack(z, lm_fingerprint="ab").to_bytes()
    assert b[:4] == MAGIC and b[4] == 1 and b[5] == 1
    assert struct.unpack_from("<III", b, 6) == (2, 1, 2)
    assert b[18] == 2 and b[19:21] == b"ab"
    assert b[21:29] == struct.pack("<2f", 1.0, -2.0)
    assert struct.unpack("<I", b[-4:])[0] == zlib.crc32(b[:-4])


def test_int8_wire_layout():
    z = torch.tensor([[[1.0, -2.54], [0.0, 0.0]], [[0.5, 0.2], [-4.0, 1.0]]])
    p = pack(z, lm_fingerprint="ab", dtype="int8")
    b = p.to_bytes()
    assert b[:4] == MAGIC and b[4] == 2 == FORMAT_VERSION and b[5] == 4
    assert struct.unpack_from("<IIII", b, 6) == (3, 2, 2, 2)
    assert b[22] == 2 and b[23:25] == b"ab"
    scales = struct.unpack_from("<4f", b, 25)  # one float32 scale per row, row-major
    assert scales == tuple(p.scale.flatten().tolist())
    assert scales[1] == 0.0 and scales[3] == pytest.approx(4.0 / 127)
    assert struct.unpack_from("<8b", b, 41) == tuple(p.latent.flatten().tolist())
    assert struct.unpack_from("<8b", b, 41) == (50, -127, 0, 0, 127, 51, -127, 32)
    assert len(b) == 41 + 8 + 4 and struct.unpack("<I", b[-4:])[0] == zlib.crc32(b[:-4])


# ---------------------------------------------------------------------------- compatibility


@pytest.mark.parametrize("hexdata, dtype, fingerprint, z", V1_SAMPLES)
def test_version_1_samples_still_read_and_written(hexdata, dtype, fingerprint, z):
    data = bytes.fromhex(hexdata)
    p = TransportPayload.from_bytes(data, expected_fingerprint=fingerprint)
    assert p.dtype == dtype and p.lm_fingerprint == fingerprint and p.format_version == 1
    assert torch.equal(p.latent, z.to(getattr(torch, dtype)))
    assert p.to_bytes() == data
    assert pack(z, lm_fingerprint=fingerprint, dtype=dtype).to_bytes() == data


def test_version_1_sample_matches_the_documented_layout():
    values = [1.5, -2.25, 0.0, 0.1]
    body = MAGIC + struct.pack("<BBI", 1, 1, 2) + struct.pack("<II", 1, 4)
    body += bytes([len(FP)]) + FP.encode() + struct.pack("<4f", *values)
    assert body + struct.pack("<I", zlib.crc32(body)) == bytes.fromhex(V1_SAMPLES[0][0])


def test_format_versions():
    assert FORMAT_VERSIONS == (1, 2) and FORMAT_VERSION == 2
    assert set(DTYPES) == {"float32", "float16", "bfloat16", "int8"}
    for dtype in FLOATS:
        assert pack(randn((2, 8)), lm_fingerprint=FP, dtype=dtype).format_version == 1
        assert pack(randn((8,)), lm_fingerprint=FP, dtype=dtype).format_version == 1
        assert pack(randn((2, 2, 8)), lm_fingerprint=FP, dtype=dtype).format_version == 2
    assert pack(randn((8,)), lm_fingerprint=FP, dtype="int8").format_version == 2


# ---------------------------------------------------------------------------- pack / unpack


def test_pack_detaches_and_copies():
    z = z32().requires_grad_(True)
    p = pack(z * 2, lm_fingerprint=FP)
    assert not p.latent.requires_grad and p.latent.grad_fn is None
    q = pack(z * 2, lm_fingerprint=FP, dtype="int8")
    assert not q.latent.requires_grad and not q.scale.requires_grad
    plain = z32()
    p = pack(plain, lm_fingerprint=FP)
    q = pack(plain, lm_fingerprint=FP, dtype="int8")
    before = unpack(q, "cpu")
    plain.add_(1.0)
    assert torch.equal(p.latent, z32())  # the sender's later edits do not reach the payload
    assert torch.equal(unpack(q, "cpu"), before)
    assert p.latent.is_contiguous() and p.latent.device.type == "cpu"
    assert pack(z32().t(), lm_fingerprint=FP).latent.is_contiguous()
    t = pack(z32(4).t(), lm_fingerprint=FP, dtype="int8")
    assert t.latent.is_contiguous() and t.scale.is_contiguous() and t.scale.shape == (32,)


def test_unpack_clones():
    p = pack(z32(), lm_fingerprint=FP)
    a, b = unpack(p, "cpu"), unpack(p, "cpu")
    assert a.data_ptr() != b.data_ptr() != p.latent.data_ptr()
    a.mul_(0)
    assert torch.equal(b, z32()) and torch.equal(p.latent, z32())
    c = unpack(pack(z32(), lm_fingerprint=FP, dtype="bfloat16"), "cpu", dtype=torch.float32)
    assert c.dtype == torch.float32 and torch.equal(c, z32().bfloat16().float())
    assert unpack(p, "cpu", dtype="float16").dtype == torch.float16


def test_unpack_int8():
    p = pack(z32(3), lm_fingerprint=FP, dtype="int8")
    a, b = unpack(p, "cpu"), unpack(p, "cpu")
    assert a.dtype == torch.float32 and a.shape == (3, 32) and a.data_ptr() != b.data_ptr()
    a.mul_(0)
    assert torch.equal(b, p.latent.float() * p.scale.unsqueeze(-1))
    assert torch.equal(unpack(p, "cpu", dtype=torch.float32), b)
    assert torch.equal(unpack(p, "cpu", dtype="bfloat16"), b.bfloat16())
    assert unpack(p, "cpu", dtype=torch.float64).dtype == torch.float64
    for bad in ("int8", torch.int8, torch.int32, "float64"):
        with pytest.raises(ValueError):
            unpack(p, "cpu", dtype=bad)
    with pytest.raises(ValueError):
        unpack(pack(z32(), lm_fingerprint=FP), "cpu", dtype="int8")


@pytest.mark.parametrize("dtype", ["float32", "int8"])
@pytest.mark.parametrize(
    "kwargs, z",
    [
        ({"dtype": torch.int32}, z32()),
        ({"dtype": "float64"}, z32()),
        ({"dtype": "uint8"}, z32()),
        ({}, torch.ones(1, 32, dtype=torch.long)),
        ({}, torch.tensor([[1.0, float("nan")]])),
        ({}, torch.tensor([[1.0, float("inf")]])),
        ({}, torch.tensor([[0.0, 0.0], [1.0, -float("inf")]])),
        ({}, torch.tensor([float("nan")] * 4)),
        ({}, torch.zeros(1, 2, 3, 4)),
        ({}, torch.zeros(0, 32)),
        ({}, torch.zeros(2, 0, 32)),
        ({}, torch.tensor(1.0)),
        ({"lm_fingerprint": ""}, z32()),
        ({"lm_fingerprint": "x" * 65}, z32()),
    ],
)
def test_pack_rejects(dtype, kwargs, z):
    kwargs = {"lm_fingerprint": FP, "dtype": dtype, **kwargs}
    with pytest.raises(ValueError):
        pack(z, **kwargs)


@pytest.mark.parametrize(
    "dtype, z",
    [
        ("float16", torch.tensor([[1e6, 1.0]])),  # overflows float16
        ("int8", torch.tensor([[1e300, 1.0]], dtype=torch.float64)),  # the scale overflows float32
        ("int8", torch.tensor([[1e39, 1.0]], dtype=torch.float64)),  # q x scale overflows float32
    ],
)
def test_pack_rejects_overflow(dtype, z):
    with pytest.raises(ValueError, match="overflows"):
        pack(z, lm_fingerprint=FP, dtype=dtype)


def test_payload_fields_must_agree():
    with pytest.raises(ValueError, match="latent_dim"):
        TransportPayload(torch.zeros(1, 32), "float32", 31, FP)
    with pytest.raises(ValueError, match="dtype"):
        TransportPayload(torch.zeros(1, 32), "float16", 32, FP)
    with pytest.raises(ValueError, match="scale"):
        TransportPayload(torch.zeros(1, 32, dtype=torch.int8), "int8", 32, FP)
    with pytest.raises(ValueError, match="scale"):
        TransportPayload(torch.zeros(2, 32, dtype=torch.int8), "int8", 32, FP, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="scale"):
        TransportPayload(torch.zeros(2, 32, dtype=torch.int8), "int8", 32, FP, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="scale"):
        TransportPayload(torch.zeros(2, 32), "float32", 32, FP, torch.zeros(2))
    with pytest.raises(ValueError, match="latent must be"):
        TransportPayload(torch.zeros(1, 1, 1, 32), "float32", 32, FP)
    ok = TransportPayload(torch.zeros(32, dtype=torch.int8), "int8", 32, FP, torch.tensor(0.5))
    assert ok.byte_length() == 36


@pytest.mark.parametrize(
    "latent, scale, reason",
    [
        (torch.zeros(1, 4, dtype=torch.int8), torch.tensor([float("nan")]), "scales"),
        (torch.zeros(1, 4, dtype=torch.int8), torch.tensor([-1.0]), "scales"),
        (torch.full((1, 4), -128, dtype=torch.int8), torch.tensor([1.0]), "-128"),
        (torch.full((1, 4), 127, dtype=torch.int8), torch.tensor([3e37]), "non-finite"),
    ],
)
def test_to_bytes_refuses_bad_int8(latent, scale, reason):
    with pytest.raises(ValueError, match=reason):
        TransportPayload(latent, "int8", 4, FP, scale).to_bytes()


def test_to_bytes_refuses_non_finite():
    p = TransportPayload(torch.tensor([[1.0, float("nan")]]), "float32", 2, FP)
    with pytest.raises(ValueError, match="non-finite"):
        p.to_bytes()


# ---------------------------------------------------------------------------- each failure


def with_nan() -> bytes:
    b = bytearray(VALID)
    start = header_length(2)
    b[start:start + 4] = struct.pack("<f", float("nan"))
    return recrc(bytes(b))


def int8_edit(scale_bytes: bytes | None = None, value: int | None = None) -> bytes:
    """VALID_INT8 with its scale and/or first int8 value replaced, CRC fixed."""
    b = bytearray(VALID_INT8)
    start = header_length(2)
    if scale_bytes is not None:
        b[start:start + 4] = scale_bytes
    if value is not None:
        b[start + 4] = value & 0xFF
    return recrc(bytes(b))


def with_version(data: bytes, version: int) -> bytes:
    return recrc(data[:4] + bytes([version]) + data[5:])


def with_code(data: bytes, code: int) -> bytes:
    return recrc(data[:5] + bytes([code]) + data[6:])


V1_3D = with_version(pack(torch.zeros(1, 2, 4), lm_fingerprint=FP).to_bytes(), 1)
V2_4D = recrc(VALID_INT8[:6] + struct.pack("<IIIII", 4, 1, 1, 1, 32) + VALID_INT8[14:])


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "truncated"),
        (VALID[:5], "truncated"),
        (VALID[:20], "truncated"),
        (VALID[:-1], "truncated"),
        (VALID_INT8[:-1], "truncated"),
        (b"ILCQ" + VALID[4:], "bad magic"),
        (with_version(VALID, 3), "unknown payload format version 3"),
        (with_version(VALID, 0), "unknown payload format version 0"),
        (with_version(VALID, 2), "non-canonical format version 2"),
        (with_version(VALID_INT8, 1), "non-canonical format version 1"),
        (with_code(VALID, 9), "unknown dtype code 9"),
        (with_code(VALID, 0), "unknown dtype code 0"),
        (with_code(VALID, 4), "non-canonical"),  # int8 in a version-1 header
        (recrc(VALID[:6] + struct.pack("<I", 3) + VALID[10:]), "bad shape"),
        (recrc(VALID[:6] + struct.pack("<I", 0) + VALID[10:]), "bad shape"),
        (recrc(VALID[:10] + struct.pack("<I", 0) + VALID[14:]), "bad shape"),
        (V1_3D, "bad shape: ndim 3; format version 1"),
        (V2_4D, "bad shape: ndim 4; format version 2"),
        (VALID + b"\x00", "trailing bytes"),
        (VALID_INT8 + b"\x00", "trailing bytes"),
        (VALID[:-4] + bytes([VALID[-4] ^ 1]) + VALID[-3:], "CRC mismatch"),
        (VALID[:40] + bytes([VALID[40] ^ 0x80]) + VALID[41:], "CRC mismatch"),
        (VALID_INT8[:30] + bytes([VALID_INT8[30] ^ 0x01]) + VALID_INT8[31:], "CRC mismatch"),
        (with_nan(), "non-finite"),
        (int8_edit(scale_bytes=struct.pack("<f", float("nan"))), "non-finite int8 scales"),
        (int8_edit(scale_bytes=struct.pack("<f", float("inf"))), "non-finite int8 scales"),
        (int8_edit(scale_bytes=struct.pack("<f", -0.5)), "negative int8 scale"),
        (int8_edit(value=-128), "-128"),
        (int8_edit(scale_bytes=struct.pack("<f", 3e37), value=100), "dequantise to non-finite"),
        ("not bytes", "bytes-like"),
        (None, "bytes-like"),
        ([1, 2, 3], "bytes-like"),
    ],
)
def test_from_bytes_reasons(data, reason):
    with pytest.raises(PayloadError, match=reason):
        TransportPayload.from_bytes(data)


def test_int8_edge_values_that_are_valid():
    # -0.0 as a scale and +-127 are legal; they decode and re-encode to the same bytes.
    for data in (int8_edit(scale_bytes=struct.pack("<f", -0.0)), int8_edit(value=-127), int8_edit(value=127)):
        assert TransportPayload.from_bytes(data).to_bytes() == data


def test_fingerprint_mismatch():
    for valid in (VALID, VALID_INT8):
        with pytest.raises(PayloadError, match=f"payload was made by LM {FP}, this receiver runs 0123456789abcdef"):
            TransportPayload.from_bytes(valid, expected_fingerprint="0123456789abcdef")
        assert TransportPayload.from_bytes(valid).lm_fingerprint == FP  # no expectation: no check


def test_bytes_like_inputs():
    for data in (bytearray(VALID), memoryview(VALID), memoryview(bytearray(VALID)).cast("B", (1, len(VALID)))):
        assert torch.equal(TransportPayload.from_bytes(data).latent, z32())
    # A strided view is read through a copy, still as the same bytes.
    doubled = bytes(x for byte in VALID_INT8 for x in (byte, 0))
    strided = memoryview(doubled)[::2]
    assert not strided.c_contiguous
    assert TransportPayload.from_bytes(strided).to_bytes() == VALID_INT8
    released = memoryview(VALID)
    released.release()
    with pytest.raises(PayloadError, match="unreadable"):
        TransportPayload.from_bytes(released)


def test_from_bytes_releases_the_callers_buffer():
    # A bytearray can be resized again after a parse, successful or not.
    for data in (VALID, VALID[:-1], VALID + b"\x00", with_nan()):
        buffer = bytearray(data)
        try:
            TransportPayload.from_bytes(buffer)
        except PayloadError:
            pass
        buffer.extend(b"\x00")


def test_payload_error_is_value_error():
    assert issubclass(PayloadError, ValueError)


# ---------------------------------------------------------------------------- size limit


def test_size_limit_boundary():
    for data, numel in ((VALID, 32), (VALID_INT8, 32), (pack(torch.zeros(2, 3, 8), lm_fingerprint=FP).to_bytes(), 48)):
        assert TransportPayload.from_bytes(data, max_elements=numel).latent.numel() == numel
        with pytest.raises(PayloadError, match=f"over the limit of max_elements={numel - 1}"):
            TransportPayload.from_bytes(data, max_elements=numel - 1)


def test_size_limit_refuses_huge_declared_shapes_before_reading():
    # A short buffer that declares 2^96 values: refused for its size, not parsed as truncated.
    huge = MAGIC + struct.pack("<BBIIII", 2, 4, 3, 2**32 - 1, 2**32 - 1, 2**32 - 1) + bytes([len(FP)]) + FP.encode()
    with pytest.raises(PayloadError, match="over the limit"):
        TransportPayload.from_bytes(huge + b"\x00" * 8)
    big = MAGIC + struct.pack("<BBIII", 1, 1, 2, DEFAULT_MAX_ELEMENTS, 2) + bytes([1]) + b"x"
    with pytest.raises(PayloadError, match=f"max_elements={DEFAULT_MAX_ELEMENTS}"):
        TransportPayload.from_bytes(big)
    with pytest.raises(PayloadError, match="truncated"):
        TransportPayload.from_bytes(big, max_elements=2 * DEFAULT_MAX_ELEMENTS)


def test_size_limit_allocates_nothing_proportional():
    # A real 4 MiB payload over the limit is refused without copying or decoding it.
    data = bytearray(pack(torch.ones(1024, 1024), lm_fingerprint=FP).to_bytes())
    tracemalloc.start()
    try:
        with pytest.raises(PayloadError, match="over the limit"):
            TransportPayload.from_bytes(data, max_elements=1000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    assert TransportPayload.from_bytes(data).latent.shape == (1024, 1024)  # within the default limit


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None, "10"])
def test_max_elements_must_be_positive_int(bad):
    with pytest.raises(ValueError, match="max_elements"):
        TransportPayload.from_bytes(VALID, max_elements=bad)


# ---------------------------------------------------------------------------- damage

PAYLOADS = [
    VALID,
    pack(z32(3, seed=1), lm_fingerprint=FP, dtype="float16").to_bytes(),
    pack(torch.randn(32), lm_fingerprint="fp-é", dtype="bfloat16").to_bytes(),
    VALID_INT8,
    pack(randn((2, 3, 8), seed=2), lm_fingerprint=FP, dtype="int8").to_bytes(),
    pack(randn((16,), seed=3), lm_fingerprint="lm", dtype="int8").to_bytes(),
    pack(randn((2, 4, 8), seed=4), lm_fingerprint=FP).to_bytes(),
]


@pytest.mark.parametrize("which", [3, 4, 5])
def test_every_int8_truncation_raises_payload_error(which):
    b = PAYLOADS[which]
    for n in range(len(b)):
        with pytest.raises(PayloadError, match="truncated"):
            TransportPayload.from_bytes(b[:n])


def damage(rng: random.Random, b: bytes) -> bytes:
    """One random corruption of b: bit flips, a truncation, byte edits, insertions, deletions."""
    kind = rng.randrange(8)
    out = bytearray(b)
    if kind == 0:
        for _ in range(rng.randint(1, 8)):
            bit = rng.randrange(8 * len(out))
            out[bit // 8] ^= 1 << (bit % 8)
    elif kind == 1:
        del out[rng.randrange(len(out)):]
    elif kind == 2:
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] = rng.randrange(256)
    elif kind == 3:
        at = rng.randrange(len(out) + 1)
        out[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif kind == 4:
        at = rng.randrange(len(out))
        del out[at:at + rng.randint(1, 8)]
    elif kind == 5:
        out += bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif kind == 6:  # the header: magic, version, dtype, ndim, shape, fingerprint length
        out[rng.randrange(min(len(out), 23))] = rng.randrange(256)
    else:
        i, j = rng.randrange(len(out)), rng.randrange(len(out))
        out[i], out[j] = out[j], out[i]
    return bytes(out)


def test_seeded_damage_always_raises_payload_error():
    rng = random.Random(20240611)
    unchanged = 0
    for i in range(4000):
        original = PAYLOADS[i % len(PAYLOADS)]
        data = damage(rng, original)
        if data == original:
            unchanged += 1
            assert TransportPayload.from_bytes(data).to_bytes() == original
            continue
        try:
            TransportPayload.from_bytes(data)
        except PayloadError:
            continue
        except Exception as e:  # anything else is a parser bug; report the input
            pytest.fail(f"iteration {i}: {type(e).__name__}: {e} for {data.hex()}")
        pytest.fail(f"iteration {i}: damaged payload decoded: {data.hex()} (from {original.hex()})")
    assert unchanged < 200


def test_seeded_damage_with_recomputed_crc():
    # The CRC fixed after the damage: every later check must refuse it, or it is a well-formed
    # payload that re-encodes to exactly these bytes.
    rng = random.Random(7)
    decoded = 0
    for i in range(3000):
        original = PAYLOADS[i % len(PAYLOADS)]
        data = damage(rng, original[:-4]) if rng.random() < 0.5 else damage(rng, original)[:-4]
        data += struct.pack("<I", zlib.crc32(data))
        try:
            p = TransportPayload.from_bytes(data)
        except PayloadError:
            continue
        except Exception as e:
            pytest.fail(f"iteration {i}: {type(e).__name__}: {e} for {data.hex()}")
        decoded += 1
        assert p.to_bytes() == data
        assert torch.isfinite(unpack(p, "cpu", dtype=torch.float32)).all()
    assert decoded > 0  # value edits that stay finite are valid payloads


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
@given(version=st.sampled_from(FORMAT_VERSIONS), tail=st.binary(max_size=300))
def test_random_bytes_after_valid_prefix_raise_only_payload_error(version, tail):
    # Past the magic and version, so the parser's later stages see arbitrary input too.
    with pytest.raises(PayloadError):
        TransportPayload.from_bytes(MAGIC + bytes([version]) + tail)


@FAST
@given(version=st.sampled_from(FORMAT_VERSIONS), code=st.integers(1, 4), body=st.binary(min_size=0, max_size=200))
def test_random_body_with_valid_crc_raises_only_payload_error(version, code, body):
    # A correct CRC over garbage: every later check must still turn it into a PayloadError.
    data = MAGIC + bytes([version, code]) + body
    data += struct.pack("<I", zlib.crc32(data))
    try:
        p = TransportPayload.from_bytes(data)
    except PayloadError:
        return
    assert torch.isfinite(unpack(p, "cpu", dtype=torch.float32)).all()  # only a well-formed payload may decode
    assert p.to_bytes() == data
