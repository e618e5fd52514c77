"""One engine process as its supervisor sees it: start, talk, watch, stop.

No policy lives here (when to restart, where requests go: :mod:`llmctl.serve.proc.engine`
and :mod:`llmctl.serve.proc.router`); this is the process, its pipe and what can be read
about it from outside (liveness, exit cause, resident memory).

Processes start from a *forkserver* that has imported torch and the engine once, so a
restart pays for the model load, not for a fresh interpreter and torch's import; fork
itself is unsafe here (the API process runs threads), which is why Python's default on
Linux is moving away from it too.
"""

from __future__ import annotations

import enum
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing.connection import Connection

from llmctl.serve.engine.stats import EngineStats
from llmctl.serve.proc.child import ChildSpec, ReadyInfo, main

# modules the forkserver imports once, so that each engine process starts with them
_PRELOAD = ["llmctl.serve.proc.forkserver_init", "llmctl.serve.proc.child",
            "llmctl.serve.engine.llm_engine", "llmctl.serve.engine.sources"]
_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            _CONTEXT = multiprocessing.get_context("forkserver")
            _CONTEXT.set_forkserver_preload(_PRELOAD)
        else:  # not on Linux: a fresh interpreter per engine
            _CONTEXT = multiprocessing.get_context("spawn")
    return _CONTEXT


class State(str, enum.Enum):
    STARTING = "starting"  # process launched, the model loading
    UP = "up"  # ready: takes requests
    DRAINING = "draining"  # over --max-rss: finishes what it has, takes nothing new
    DOWN = "down"  # exited or killed; a restart is scheduled
    STOPPED = "stopped"  # shut down on purpose


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class Replica:
    """A supervised engine process (index ``index`` of the server's replicas)."""

    def __init__(self, index: int, spec: ChildSpec) -> None:
        self.index = index
        self.spec = spec
        self.state = State.STOPPED
        self.process = None
        self.conn: Connection | None = None
        self.info: ReadyInfo | None = None
        self.stats: EngineStats | None = None  # the last snapshot it sent
        self.started_at = 0.0  # monotonic: launched
        self.ready_at = 0.0  # monotonic: ready message received
        self.last_heard = 0.0  # monotonic: last message (each step sends one)
        self.busy_since = 0.0  # monotonic: went from no requests to some
        self.death: str | None = None  # why it went down, for logs and error messages
        # the process is known to have exited (its sentinel fired, or its pipe closed),
        # whether or not the supervisor has handled it yet (state DOWN): /health reads it
        self.gone = False
        self._send_lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------
    def start(self, generation: int) -> None:
        ctx = _context()
        parent_end, child_end = ctx.Pipe(duplex=True)
        spec = ChildSpec(**{**self.spec.__dict__, "generation": generation})
        self.process = ctx.Process(target=main, args=(child_end, spec), daemon=True,
                                   name=f"llmctl-engine-{self.index}")
        self.process.start()
        child_end.close()  # ours closed: the child's exit is EOF on parent_end
        self.conn = parent_end
        self.state = State.STARTING
        self.started_at = self.last_heard = time.monotonic()
        self.stats, self.death, self.info = None, None, None
        self.gone = False

    def mark_ready(self, info: ReadyInfo) -> float:
        """Seconds from launch to ready."""
        self.info = info
        self.state = State.UP
        self.ready_at = self.last_heard = time.monotonic()
        return self.ready_at - self.started_at

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def exited(self) -> bool:
        return self.process is not None and not self.process.is_alive()

    def exit_cause(self) -> str:
        code = None if self.process is None else self.process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the engine to exit after its step; kill it if it does not."""
        if self.process is None:
            return
        self.send(("stop",))
        self.process.join(timeout)
        self.kill()
        self.process.join(1.0)
        self.close_pipe()
        self.state = State.STOPPED

    def close_pipe(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    # --- talk -------------------------------------------------------------------------
    def send(self, message: tuple) -> bool:
        """False when the pipe is gone (the death is handled where it is noticed)."""
        with self._send_lock:
            if self.conn is None:
                return False
            try:
                self.conn.send(message)
                return True
            except (OSError, EOFError, ValueError):
                return False

    def receive(self) -> tuple[list[tuple], bool]:
        """Every message waiting on the pipe, and whether it reached end-of-file."""
        messages = []
        if self.conn is None:
            return messages, True
        try:
            while self.conn.poll():
                messages.append(self.conn.recv())
        except (EOFError, OSError):
            return messages, True
        if messages:
            self.last_heard = time.monotonic()
        return messages, False

    def rss_bytes(self) -> int | None:
        """Resident memory of the engine process (Linux ``/proc``), None if unknown."""
        if self.pid is None:
            return None
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                return int(f.read().split()[1]) * _PAGE
        except (OSError, ValueError, IndexError):
            return None
