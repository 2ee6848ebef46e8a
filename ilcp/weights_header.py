"""The header of a safetensors file, read without loading a tensor: 8 bytes (little-endian
unsigned length N), then N bytes of JSON mapping each tensor's name to its dtype, shape and
offsets (and ``__metadata__``).

`ilcp.export.read_export` compares the shapes an export's config.json declares with the header
of its weights file before anything is built, so settings edited to build a far larger encoder
(``compressor.hidden_dim: 23000``, its digest recomputed) are refused in milliseconds, not after
gigabytes are allocated.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["MAX_HEADER_BYTES", "HeaderError", "safetensors_shapes"]

# far above the header of any export (a few kB), far below what reading it would cost
MAX_HEADER_BYTES = 16 << 20


class HeaderError(ValueError):
    """A file whose safetensors header cannot be read."""


def safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` from the header of the safetensors file at `path`.

    Raises:
        HeaderError: one line: the file is shorter than its header says, the header is too
            long, not JSON, or not a mapping of tensors with integer shapes.
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"{path} is not a safetensors file: shorter than its 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise HeaderError(f"{path} is not a safetensors file: its header length {n:,} exceeds "
                              f"{'the file' if n > size - 8 else f'{MAX_HEADER_BYTES:,} bytes'}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError):
            raise HeaderError(f"{path} is not a safetensors file: its header is not JSON") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path} is not a safetensors file: its header is not a JSON object")
    shapes = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise HeaderError(f"{path}: the header gives tensor {name!r} no shape")
        shapes[name] = tuple(shape)
    return shapes
