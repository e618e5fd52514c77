"""Keep the eval's resident memory flat across windows (glibc only).

Every window allocates and frees a ctx x vocab logits buffer (100 MB for SmolLM2)
and row-chunk scratch. glibc raises its mmap threshold each time a large mmapped
block is freed (up to 32 MiB), so later scratch comes from the heap, where small
long-lived objects pin it: RSS then creeps up window after window (measured: +300 MB
over 32 windows). Fixing the threshold turns the dynamic adjustment off, so large
buffers go back to the OS when freed. Costs a few page faults per window.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # from <malloc.h>
THRESHOLD_BYTES = 1 << 20


def pin_mmap_threshold(threshold: int = THRESHOLD_BYTES) -> bool:
    """Set glibc's M_MMAP_THRESHOLD; False where there is no glibc (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False
