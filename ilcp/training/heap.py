"""The process heap under variable-length batches (glibc).

Training batches differ in length, so every step frees and allocates tensors of new sizes. glibc
serves a large allocation by mapping pages and returns them on free, but after each such free it
raises its threshold for mapping, so later tensors of that size come from the heap, where freed
blocks of odd sizes fragment it and the resident memory climbs step after step. `hold_heap_flat`
fixes the threshold (128 KiB, glibc's own default), so every large tensor's pages go back to the
system when it is freed; `return_freed` hands back what the heap holds free between stages.
Both do nothing where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 128 * 1024

_libc = None


def _glibc():
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc = libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else False
        except OSError:
            _libc = False
    return _libc or None


def hold_heap_flat() -> bool:
    """Map every allocation of `MMAP_THRESHOLD` bytes or more (a fixed threshold); False where
    this is not glibc."""
    libc = _glibc()
    return bool(libc and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def return_freed() -> bool:
    """Give the heap's free memory back to the system (``malloc_trim(0)``); False where this is not
    glibc or nothing could be given back."""
    libc = _glibc()
    return bool(libc and libc.malloc_trim(0))
