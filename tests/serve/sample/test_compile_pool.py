"""The grammar compile pool: results and errors come back, a compile past the time
limit is refused at the limit (and its thread is free again once it ends), and while
every thread is busy a new compile is refused as busy instead of waiting forever."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from llmctl.serve.sample.compile_pool import (
    STACK_BYTES,
    CompileBusyError,
    CompilePool,
    CompileTimeoutError,
)


def test_results_and_errors_come_back():
    pool = CompilePool(workers=1, time_limit=5)
    assert pool.run(lambda: 42) == 42
    with pytest.raises(ZeroDivisionError):
        pool.run(lambda: 1 / 0)


def test_a_slow_compile_is_refused_at_the_limit():
    pool = CompilePool(workers=1, time_limit=0.1)
    start = time.monotonic()
    with pytest.raises(CompileTimeoutError, match="longer than 0.1 s"):
        pool.run(lambda: time.sleep(0.6))
    assert time.monotonic() - start < 0.4
    time.sleep(0.6)  # the straggler ends; its thread takes the next job
    assert pool.run(lambda: "next") == "next"


def test_a_busy_pool_refuses_rather_than_queues_forever():
    pool = CompilePool(workers=1, time_limit=0.2)
    release = threading.Event()
    blocker = threading.Thread(target=lambda: pytest.raises(
        CompileTimeoutError, pool.run, lambda: release.wait(5)))
    blocker.start()
    time.sleep(0.05)  # the blocker holds the only thread
    with pytest.raises(CompileBusyError, match="retry later"):
        pool.run(lambda: "never runs")
    release.set()
    blocker.join(5)
    assert pool.run(lambda: "after") == "after"


def _own_stack_bytes() -> int:
    """The calling thread's stack size, as glibc set it up (pthread_getattr_np)."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    attr = ctypes.create_string_buffer(128)  # pthread_attr_t: 56 bytes on x86-64
    assert libc.pthread_getattr_np(ctypes.c_ulong(libc.pthread_self()), attr) == 0
    addr, size = ctypes.c_void_p(), ctypes.c_size_t()
    libc.pthread_attr_getstack(attr, ctypes.byref(addr), ctypes.byref(size))
    libc.pthread_attr_destroy(attr)
    return size.value


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's pthread_getattr_np")
def test_threads_have_the_large_stack():
    """llguidance compiles recursively: a deep Lark chain segfaults an 8 MiB stack."""
    pool = CompilePool(workers=1, time_limit=5)
    assert pool.run(_own_stack_bytes) >= STACK_BYTES
    assert threading.stack_size() == 0  # the process-wide setting was restored
