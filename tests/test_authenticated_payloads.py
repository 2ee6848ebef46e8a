"""Authenticated payloads: HMAC-SHA256 under a shared key refuses every deliberate edit; without a
key the CRC-checked format is unchanged."""

import random
import struct
import zlib

import pytest
import torch

from ilcp.handoff import ILCPHandoff
from ilcp.wire.payload import PayloadError, TransportPayload, pack
from ilcp.wire.seal import open_sealed, seal

KEY = b"k" * 32
FP = "0123456789abcdef"


def _payload():
    return pack(torch.linspace(-1, 1, 32), lm_fingerprint=FP)


def _edit_with_crc(wire: bytes, offset: int) -> bytes:
    """Change one latent byte and recompute the CRC: a deliberate edit CRC cannot catch."""
    body = bytearray(wire[:-4])
    body[offset] ^= 0x40
    return bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))


def test_crc_alone_accepts_a_deliberate_edit_and_the_key_refuses_it():
    wire = _payload().to_bytes()
    edited = _edit_with_crc(wire, len(wire) - 10)
    assert not torch.equal(TransportPayload.from_bytes(edited).latent, _payload().latent)
    sealed = seal(edited, KEY)  # the attacker cannot reseal without the key: use another key
    with pytest.raises(PayloadError, match="authentication failed"):
        open_sealed(seal(edited, b"x" * 32), KEY)
    assert TransportPayload.from_bytes(sealed, key=KEY).latent.shape == (32,)


def test_sealed_round_trip_and_refusals():
    p = _payload()
    sealed = p.to_bytes(KEY)
    assert len(sealed) == len(p.to_bytes()) + 5 + 16 + 8 + 32  # magic, version, nonce, time, tag
    torch.testing.assert_close(TransportPayload.from_bytes(sealed, key=KEY).latent, p.latent, rtol=0, atol=0)
    with pytest.raises(PayloadError, match="shared key is needed"):
        TransportPayload.from_bytes(sealed)
    with pytest.raises(PayloadError, match="not authenticated"):
        TransportPayload.from_bytes(p.to_bytes(), key=KEY)
    with pytest.raises(PayloadError, match="authentication failed"):
        TransportPayload.from_bytes(sealed, key=b"z" * 32)
    with pytest.raises(ValueError, match="key"):
        p.to_bytes(b"short")


def test_every_mutation_of_a_sealed_payload_is_refused():
    rng = random.Random(0)
    sealed = _payload().to_bytes(KEY)
    refused = 0
    for _ in range(2000):
        data = bytearray(sealed)
        kind = rng.randrange(4)
        if kind == 0:
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(len(data))
                data[i] ^= 1 << rng.randrange(8)
        elif kind == 1:
            data = data[: rng.randrange(len(data))]
        elif kind == 2:
            data[rng.randrange(len(data))] = rng.randrange(256)
        else:
            data += bytes([rng.randrange(256)])
        if bytes(data) == sealed:
            continue
        with pytest.raises(PayloadError):
            TransportPayload.from_bytes(bytes(data), key=KEY)
        refused += 1
    assert refused > 1900


def test_handoffs_with_a_shared_key(tiny_run, tiny_lm):
    sender = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, auth_key=KEY)
    receiver = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, auth_key=KEY)
    wire = sender.to_wire(sender.send("John went to the garden."))
    assert isinstance(receiver.receive(wire, "Where is John?", max_new_tokens=2), str)
    plain = ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm)
    with pytest.raises(PayloadError, match="shared key"):
        plain.receive(wire, "Where is John?")
    with pytest.raises(PayloadError, match="not authenticated"):
        receiver.receive(plain.to_wire(plain.send("John went to the garden.")), "Where is John?")
    with pytest.raises(ValueError, match="key"):
        ILCPHandoff.from_pretrained(tiny_run.run_dir, lm=tiny_lm, auth_key="secret")


def test_replay_guard_refuses_replays_old_future_and_nonce_less_envelopes_with_bounded_memory():
    from ilcp.wire.seal import ReplayGuard, open_envelope

    now = [1_000_000.0]
    guard = ReplayGuard(max_age=60, max_nonces=3, max_skew=5, clock=lambda: now[0])
    wire = _payload().to_bytes()

    def receive(sealed):
        return TransportPayload.from_bytes(sealed, key=KEY, guard=guard)

    sealed = [seal(wire, KEY, created_at=now[0] - 10 + i) for i in range(4)]
    receive(sealed[0])
    with pytest.raises(PayloadError, match="replayed"):
        receive(sealed[0])
    with pytest.raises(PayloadError, match="max_age of 60 s"):
        receive(seal(wire, KEY, created_at=now[0] - 61))
    with pytest.raises(PayloadError, match="ahead of this receiver's clock"):
        receive(seal(wire, KEY, created_at=now[0] + 6))
    for s in sealed[1:]:
        receive(s)
    assert len(guard) == 3  # the first nonce was forgotten to stay within max_nonces ...
    with pytest.raises(PayloadError, match="older than the 3 payloads"):
        receive(sealed[0])  # ... and its replay is still refused
    now[0] += 120  # every nonce has expired with the window, and the envelopes with max_age
    with pytest.raises(PayloadError, match="old"):
        receive(sealed[3])
    receive(seal(wire, KEY, created_at=now[0]))
    assert len(guard) == 1
    envelope = open_envelope(seal(wire, KEY, nonce=b"n" * 16, created_at=12.5), KEY)
    assert (envelope.version, envelope.nonce, envelope.created_at, envelope.payload) == (2, b"n" * 16, 12.5, wire)
    with pytest.raises(ValueError, match="replay_window"):
        ReplayGuard(max_age=60, replay_window=30)
    with pytest.raises(ValueError, match="max_age"):
        ReplayGuard(max_age=-1)
