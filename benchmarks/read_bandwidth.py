"""The memory's read bandwidth, as a decode step could at best stream its weights: a
STREAM-style read loop (sum of a large buffer) compiled here with the system compiler at
``-O3 -march=native -fopenmp``, the threads each summing one contiguous part, every 4 KiB
page's lines prefetched a page ahead (as ``csrc/gemm_bf16.cpp`` streams its weights).

A torch ``Tensor.sum`` or a copy understate it on the Intel Xeon guests: their loops
issue too few outstanding reads per core, and llmctl's own decode streamed faster than
either (a float32 ``sum`` read 18-23 GB/s while decode rounds moved 24 GB/s of weights).
The bound a decode is held to must be at least what the memory can deliver, so it is
this loop's rate, best of a few passes over a buffer far larger than the caches.

    python benchmarks/read_bandwidth.py      # prints GB/s
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
import time
from functools import lru_cache
from pathlib import Path

SOURCE = r"""
#include <cstdint>
extern "C" uint64_t read_sum(const uint64_t* p, int64_t pages, int threads) {
  uint64_t total = 0;
#pragma omp parallel for schedule(static) reduction(+ : total) num_threads(threads)
  for (int64_t page = 0; page < pages; ++page) {
    const uint64_t* q = p + page * 512;
    for (int line = 0; line < 64; ++line) __builtin_prefetch(q + 512 + line * 8);
    uint64_t s = 0;
    for (int i = 0; i < 512; ++i) s += q[i];
    total += s;
  }
  return total;
}
"""


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler for the read-bandwidth loop")
    out = Path(tempfile.mkdtemp(prefix="llmctl-readbw-"))
    (out / "read.cpp").write_text(SOURCE)
    subprocess.run([cxx, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC",
                    str(out / "read.cpp"), "-o", str(out / "read.so")], check=True)
    lib = ctypes.CDLL(str(out / "read.so"))
    lib.read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.read_sum.restype = ctypes.c_uint64
    return lib


def read_bandwidth(size_mib: int = 512, repeats: int = 5, threads: int | None = None) -> float:
    """Bytes read per second, best of ``repeats`` passes over ``size_mib``."""
    import torch

    data = torch.ones(size_mib * 2**20 // 8, dtype=torch.int64)
    pages = data.numel() // 512
    threads = threads or torch.get_num_threads()
    fn = _library().read_sum
    fn(data.data_ptr(), pages, threads)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        total = fn(data.data_ptr(), pages, threads)
        best = min(best, time.perf_counter() - t)
    assert total == pages * 512  # every element read
    return pages * 4096 / best


if __name__ == "__main__":
    print(f"{read_bandwidth() / 1e9:.1f} GB/s")
