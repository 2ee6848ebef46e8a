"""The authenticated envelope around payload bytes, and the receiver's replay guard.

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

The envelope wraps bytes and knows nothing of what they hold: `ilcp.wire.payload` seals its
bytes with `seal` and, with a key, opens them with `unseal` before it reads them.
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
from collections.abc import Callable
from dataclasses import dataclass

from ..checks import check_key, positive_int
from .errors import PayloadError

__all__ = ["NONCE_BYTES", "SEAL_MAGIC", "SEAL_VERSION", "SEAL_VERSIONS", "Envelope", "ReplayGuard", "is_sealed",
           "open_envelope", "open_sealed", "seal", "unseal"]

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
    accepted, so memory stays bounded without letting a replay through. `release(envelope)`
    forgets a nonce again, for a receiver whose open of it was refused after the check.
    Thread-safe; in memory only (a restarted receiver starts with an empty memory, protected by
    ``max_age`` alone).

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

    def release(self, envelope: Envelope) -> None:
        """Forget the nonce `check` recorded for ``envelope``, when the open it began was refused
        afterwards (a shape, a value, or an argument of the call): the same sealed bytes can then
        be opened again. Until released, the nonce refuses every other open of them, so two
        concurrent opens never both succeed. Nothing for a nonce not held."""
        nonce = envelope.nonce
        with self._lock:
            if nonce is None or nonce not in self._seen:
                return
            self._seen.discard(nonce)
            self._by_time = [entry for entry in self._by_time if entry[1] != nonce]
            heapq.heapify(self._by_time)


def unseal(data, *, key: bytes | None, guard: ReplayGuard | None = None, max_bytes: int | None = None,
           limit: str = "this receiver accepts"):
    """The payload bytes of what arrived: with ``key``, the inside of its envelope once the tag
    verifies and ``guard`` (if any) accepts it; without a key, ``data`` itself, refused if sealed.

    Args:
        max_bytes: sealed bytes longer than this are refused before the tag is computed.
        limit: what ``max_bytes`` stands for, with the fix, in that refusal ("... exceeds the N
            bytes {limit}").

    Raises:
        PayloadError: an unreadable buffer, sealed bytes over ``max_bytes``, what `open_envelope`
            and `ReplayGuard.check` refuse; sealed bytes without a key.
    """
    if key is None:
        if is_sealed(data):
            raise PayloadError("authenticated payload: a shared key is needed to read it")
        return data
    try:
        size = memoryview(data).nbytes if isinstance(data, (bytes, bytearray, memoryview)) else 0
    except (ValueError, TypeError, BufferError) as e:
        raise PayloadError(f"payload buffer is unreadable: {e}") from None
    if max_bytes is not None and size > max_bytes:
        raise PayloadError(f"sealed payload of {size} bytes exceeds the {max_bytes} bytes {limit}")
    envelope = open_envelope(data, key)
    if guard is not None:
        guard.check(envelope)
    return envelope.payload
