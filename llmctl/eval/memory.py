"""Keep the eval's resident memory flat across windows (glibc only), and only the eval's.

Every window allocates and frees a ctx x vocab logits buffer (100 MB for SmolLM2)
and row-chunk scratch. glibc raises its mmap threshold each time a large mmapped
block is freed (up to 32 MiB), so later scratch comes from the heap, where small
long-lived objects pin it: RSS then creeps up window after window (measured: +300 MB
over 32 windows). Fixing the threshold at 1 MiB turns the dynamic adjustment off, so
large buffers go back to the OS when freed. Costs a few page faults per window.

The setting is process-wide, and a process that runs more after an eval (``llmctl
check``: the next candidate's quantization; a test session) must not keep it: at 1 MiB
every activation is a fresh mmap and its pages are faulted in again, which made an AWQ
quantization after an eval 2.3x slower (93 s against 40 s, 77 s of it in the kernel).
glibc cannot go back to its dynamic mode once a threshold is set, so :func:`flat_heap`
leaves the values that mode settles at in a long-running process: the mmap threshold at
its dynamic ceiling (32 MiB on 64-bit) and the trim threshold at twice that (measured:
that AWQ run 40.6 s again, 2.5 s in the kernel).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager

M_TRIM_THRESHOLD = -1  # from <malloc.h>
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 20
# glibc's DEFAULT_MMAP_THRESHOLD_MAX (4 MiB x sizeof(long)); dynamic mode trims at 2x
SETTLED_MMAP_BYTES = 32 << 20
SETTLED_TRIM_BYTES = 2 * SETTLED_MMAP_BYTES


def _mallopt(param: int, value: int) -> bool:
    """glibc's mallopt; False where there is no glibc (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(param, int(value)))
    except (OSError, AttributeError):
        return False


def pin_mmap_threshold(threshold: int = THRESHOLD_BYTES) -> bool:
    """Set glibc's M_MMAP_THRESHOLD for the rest of the process (a benchmark that
    measures the eval alone); code that goes on afterwards uses :func:`flat_heap`."""
    return _mallopt(M_MMAP_THRESHOLD, threshold)


@contextmanager
def flat_heap(threshold: int = THRESHOLD_BYTES) -> Iterator[bool]:
    """The mmap threshold pinned at ``threshold`` inside the block, the settled dynamic
    values after it (module doc); yields whether glibc took the setting."""
    pinned = pin_mmap_threshold(threshold)
    try:
        yield pinned
    finally:
        if pinned:
            _mallopt(M_MMAP_THRESHOLD, SETTLED_MMAP_BYTES)
            _mallopt(M_TRIM_THRESHOLD, SETTLED_TRIM_BYTES)
