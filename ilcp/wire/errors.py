"""The one error of the wire: bytes that are not a payload this receiver reads."""


class PayloadError(ValueError):
    """Bytes that are not a valid payload for this receiver; the message gives the reason."""
