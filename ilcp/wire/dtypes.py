"""The dtypes a payload's latent crosses in, and int8 quantisation.

Payload dtypes (``dtype=`` of `pack`, a name or the torch dtype):
- ``"float32"``, ``"float16"``, ``"bfloat16"``: the latent cast to that dtype; float32 round-trips
  exactly.
- ``"int8"``: symmetric absmax quantisation per row (per latent vector, the last axis): for a
  row x, ``scale = max|x| / 127`` stored as float32 (rounded up, so that ``|x / scale| <= 127``),
  ``q = round(x / scale)`` in -127..127 (-128 is never written and is refused when read); an
  all-zero row has scale 0 and q 0. `unpack` dequantises to ``q * scale`` in float32 (or the
  float dtype asked for); each value is off by at most ``scale / 2`` (plus float32 rounding of
  the product).
"""

from __future__ import annotations

import math

import numpy as np
import torch

# name -> (dtype code, torch dtype of the payload's latent, little-endian numpy dtype of the raw values)
DTYPE_TABLE = {
    "float32": (1, torch.float32, np.dtype("<f4")),
    "float16": (2, torch.float16, np.dtype("<f2")),
    "bfloat16": (3, torch.bfloat16, np.dtype("<i2")),
    "int8": (4, torch.int8, np.dtype("i1")),
}
DTYPES = tuple(DTYPE_TABLE)
CODES = {code: name for name, (code, _, _) in DTYPE_TABLE.items()}
TORCH_NAMES = {tdtype: name for name, (_, tdtype, _) in DTYPE_TABLE.items()}
QUANTISED = frozenset({"int8"})
SCALE_NP = np.dtype("<f4")
INT8_MAX = 127


def dtype_name(dtype: str | torch.dtype) -> str:
    """The payload dtype name for a name or torch dtype; ValueError for anything else."""
    if isinstance(dtype, torch.dtype):
        if dtype not in TORCH_NAMES:
            raise ValueError(f"payload dtype must be one of {sorted(DTYPE_TABLE)}, got {dtype}")
        return TORCH_NAMES[dtype]
    if not isinstance(dtype, str) or dtype not in DTYPE_TABLE:
        raise ValueError(f"payload dtype must be one of {sorted(DTYPE_TABLE)}, got {dtype!r}")
    return dtype


def quantise_int8(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row absmax int8: z (..., Z) finite -> (q int8 (..., Z), scale float32 (...)).

    The scale is max|row| / 127 rounded up to a float32, so every |x / scale| <= 127 and each
    dequantised value q * scale is within scale / 2 of x. Computed in float64 on the CPU.
    """
    x = z.detach().to(device="cpu", dtype=torch.float64)
    exact = x.abs().amax(dim=-1) / INT8_MAX
    scale = exact.to(torch.float32)
    scale = torch.where(scale.double() < exact, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("z overflows int8: a row's scale max|x| / 127 is out of float32's range")
    s = scale.double().unsqueeze(-1)
    q = torch.where(s > 0, torch.round(x / torch.where(s > 0, s, 1.0)), 0.0)
    q = q.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    if not bool(torch.isfinite(dequantise(q, scale)).all()):
        raise ValueError("z overflows int8: its dequantised values are out of float32's range")
    return q, scale


def dequantise(q: torch.Tensor, scale: torch.Tensor, device: str | torch.device | None = None) -> torch.Tensor:
    """int8 values (..., Z) and their float32 row scales (...) -> float32 (..., Z), q * scale."""
    return q.to(device=device, dtype=torch.float32) * scale.to(device=device, dtype=torch.float32).unsqueeze(-1)
