"""Where grammars compile: worker threads with a large stack, beside the caller, under a
time limit.

Why threads of their own:

- llguidance compiles recursively in Rust: a Lark grammar that chains a few thousand
  rules overflows an 8 MiB thread stack and kills the whole process (a segfault, not an
  exception). These threads get :data:`STACK_BYTES` (virtual memory: only the pages a
  compile touches are ever mapped).
- Compiling drops the GIL, so the event loop and the engine's step thread go on while a
  large grammar compiles here; the caller waits on a future, at most ``time_limit``
  seconds, and a grammar still compiling then is the client's problem (an error), not
  every other request's.

A compile past its time limit cannot be interrupted (Rust holds the thread); it runs on
to the end that llguidance's own limits (``LLParserLimits``) and the server's size
limit bound, then its thread takes the next job. While every thread is busy that way, a
new grammar waits its turn for at most ``time_limit`` and is then refused as "busy"
(:class:`CompileBusyError`, a retry later), so stragglers delay grammars only, never a
request without one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

STACK_BYTES = 256 << 20  # a 10k-rule Lark chain needs about 30 MiB
DEFAULT_WORKERS = 2
DEFAULT_TIME_LIMIT_S = 2.0  # llguidance: "100-1000ms for extremely complex grammars"

_STACK_LOCK = threading.Lock()  # threading.stack_size() is process-wide


class CompileTimeoutError(ValueError):
    """The grammar did not compile within the time limit: too complex for this server."""


class CompileBusyError(RuntimeError):
    """Every compile thread was busy for the whole time limit: retry later."""


class CompilePool:
    def __init__(self, workers: int = DEFAULT_WORKERS,
                 time_limit: float = DEFAULT_TIME_LIMIT_S) -> None:
        self.workers = workers
        self.time_limit = time_limit
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._start_lock = threading.Lock()

    def _start(self) -> None:
        """The threads start on first use: a server never sent a grammar holds none."""
        with self._start_lock:
            if self._started:
                return
            with _STACK_LOCK:
                previous = threading.stack_size(STACK_BYTES)
                try:
                    for i in range(self.workers):
                        threading.Thread(target=self._work, name=f"llmctl-grammar-{i}",
                                         daemon=True).start()
                finally:
                    threading.stack_size(previous)
            self._started = True

    def _work(self) -> None:
        while True:
            fn, future, running = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # refused as busy before it started
            running.set()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)

    def run(self, fn: Callable[[], Any], limited: bool = True) -> Any:
        """``fn()`` on a compile thread; ``limited``: within ``time_limit`` (else wait to
        the end: an engine process compiling what the frontend already compiled once)."""
        self._start()
        future: Future = Future()
        running = threading.Event()
        self._jobs.put((fn, future, running))
        if not limited:
            return future.result()
        if not running.wait(self.time_limit) and future.cancel():
            raise CompileBusyError(
                f"every grammar compile thread stayed busy for {self.time_limit:g} s; "
                "retry later")
        try:
            return future.result(timeout=self.time_limit)
        except FutureTimeout:
            raise CompileTimeoutError(
                f"compiling took longer than {self.time_limit:g} s, this server's limit; "
                "simplify the grammar or schema") from None
