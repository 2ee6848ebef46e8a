"""The wire: what crosses between the sender's and the receiver's agents.

- `ilcp.wire.payload`: `TransportPayload`, its byte format (`to_bytes`, `from_bytes`, `opened`),
  `pack` and `unpack`;
- `ilcp.wire.dtypes`: the dtypes a latent crosses in, and int8 quantisation;
- `ilcp.wire.seal`: the authenticated envelope around the bytes, and the replay guard;
- `ilcp.wire.errors`: `PayloadError`, the one error for bytes a receiver does not read.

Each imports only the ones below it: payload -> seal -> errors, payload -> dtypes.
"""

from .dtypes import DTYPES
from .errors import PayloadError
from .payload import DEFAULT_MAX_ELEMENTS, TransportPayload, WireHeader, opened, pack, unpack, wire_length
from .seal import SEAL_MAGIC, Envelope, ReplayGuard, is_sealed, open_envelope, open_sealed, seal, unseal

__all__ = ["DEFAULT_MAX_ELEMENTS", "DTYPES", "SEAL_MAGIC", "Envelope", "PayloadError", "ReplayGuard", "TransportPayload",
           "WireHeader", "is_sealed", "open_envelope", "open_sealed", "opened", "pack", "seal", "unpack", "unseal",
           "wire_length"]
