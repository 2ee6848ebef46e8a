"""Compute precision: one setting for every forward through the frozen LM.

The setting (`trainer.precision` in a training config, ``--precision`` in eval, ``precision=`` of
`ILCPHandoff.from_pretrained`) is one of

- ``"32-true"``: float32 everywhere (the default);
- ``"bf16-mixed"``: the LM's matmuls run in bfloat16 under autocast; weights, trained modules,
  exports and payloads stay float32;
- ``"auto"``: ``"bf16-mixed"`` where the hardware computes bfloat16 natively (a CPU reporting
  AVX512-BF16 or AMX, a CUDA GPU that supports it), else ``"32-true"``.

`resolve` turns ``"auto"`` into the precision used, which runs record (export config.json, eval's
results.json). Lightning's trainers take the resolved name as is; code outside a trainer enters
`autocast` around its forwards.

    from ilcp.precision import autocast, resolve
    precision = resolve("auto", device)        # "bf16-mixed" on an AMX CPU
    with autocast(precision, device):
        out = model(input_ids)
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

from .names import PRECISIONS

__all__ = ["PRECISIONS", "autocast", "check_precision", "cpu_has_native_bf16", "native_bf16", "resolve"]

_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def check_precision(precision: str) -> str:
    """``precision`` if it is one of `PRECISIONS`, else ValueError naming them."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags as Linux reports them in /proc/cpuinfo (empty elsewhere)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and ":" in line:
            flags.update(line.split(":", 1)[1].split())
    return flags


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 matmuls natively (AVX512-BF16 or AMX)."""
    return any(flag in cpu_flags() for flag in _NATIVE_BF16_FLAGS)


def native_bf16(device) -> bool:
    """Whether ``device`` (a torch.device or its name) computes bfloat16 natively."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return cpu_has_native_bf16()
    return False


def resolve(precision: str, device="cpu") -> str:
    """The precision used on ``device``: ``"auto"`` becomes ``"bf16-mixed"`` or ``"32-true"``."""
    check_precision(precision)
    if precision == "auto":
        return "bf16-mixed" if native_bf16(device) else "32-true"
    return precision


def autocast(precision: str, device="cpu"):
    """A context in which forwards on ``device`` run at ``precision`` (resolved first): torch's
    bfloat16 autocast for ``"bf16-mixed"``, nothing for ``"32-true"``."""
    import torch

    if resolve(precision, device) == "32-true":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
