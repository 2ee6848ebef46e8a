"""A CPU training process's resident memory: oneDNN's kernel caches kept small, freed pages given back.

Two things make a training process on CPU grow with its steps instead of with what one step holds:

- oneDNN, which runs the bfloat16 matmuls, keeps each kernel it builds in a cache keyed by the
  shapes it was built for, and PyTorch's oneDNN layer keeps a second cache of the same kind; both
  hold 1,024 entries by default. A batch of new sequence lengths builds new kernels, so over a run
  of varied batches both caches fill. `bound_kernel_caches` caps both at `KERNEL_CACHE_CAPACITY`
  entries, enough for the kernels one step reuses. Both caches read their capacity once, when the
  process builds its first kernel: `ilcp.training.train` calls it before it loads an LM, and in a
  process that has already run a kernel the call changes nothing.
- glibc keeps the pages of freed tensors for later allocations, so a stage would start on top of
  the peak of the one before (a validation pass, the slot statistics' long padded forwards):
  `give_back_freed_memory` hands them back (the trainers call it as a stage starts and after each
  validation pass, `ilcp.training.log.GiveBackFreedMemory`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

KERNEL_CACHE_CAPACITY = 64
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> dict[str, str]:
    """Cap oneDNN's kernel cache and PyTorch's at `capacity` entries each (the environment
    variables both read), leaving a capacity the environment already sets; returns the values in
    force. Effective only before the process builds its first oneDNN kernel (see the module docstring)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"a kernel cache capacity must be an int >= 1, got {capacity!r}")
    return {name: os.environ.setdefault(name, str(capacity)) for name in KERNEL_CACHE_VARIABLES}


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def give_back_freed_memory() -> None:
    """Hand the memory the process has freed back to the system (glibc's ``malloc_trim``; nothing
    where the C library has none)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
