"""Run the app under uvicorn with a graceful shutdown.

On SIGTERM/SIGINT uvicorn stops accepting connections and waits for in-flight ones.
Shortly before the grace period ends we fail whatever is still generating, so every
stream ends with an error event instead of a cut connection; then the process exits 0.

On SIGHUP (with ``--auth-file``) the key file is read again and swapped in whole
(:meth:`llmctl.serve.api.tenancy.gate.Tenancy.reload`); nothing else stops or waits, so
requests in flight carry on. The handler runs on the main thread, which is the event
loop's: it only reads a small file and replaces one reference, and it never raises.

Nagle's algorithm is off without our help: asyncio's socket transports (and uvloop's)
set TCP_NODELAY on every TCP connection they create, so each SSE chunk leaves when the
handler writes it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
from collections.abc import Callable, Iterator

import uvicorn

from llmctl.serve.engine.async_engine import AsyncEngine, EngineDeadError

log = logging.getLogger("llmctl.serve")


# query parameters that may carry a credential: never written to a log (clients that
# cannot set headers put keys there, whether or not this server reads them)
_SECRET_QUERY = re.compile(
    r"(?i)([?&;](?:api[_-]?key|key|access[_-]?token|token|auth|authorization|password|"
    r"secret)=)[^&;#\s\"]*")


def redact_query(text: str) -> str:
    """``/v1/models?api_key=sk-1&x=2`` -> ``/v1/models?api_key=REDACTED&x=2``."""
    return _SECRET_QUERY.sub(r"\1REDACTED", text)


class RedactQueryFilter(logging.Filter):
    """On uvicorn's access log: the request line's query string without credentials."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a
                                for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True


def redact_access_log() -> None:
    """Install :class:`RedactQueryFilter` on uvicorn's access logger (once)."""
    logger = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactQueryFilter) for f in logger.filters):
        logger.addFilter(RedactQueryFilter())


class _GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, grace: float,
                 on_reload: Callable[[], object] | None = None) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace = grace
        self._timer: threading.Timer | None = None
        self._on_reload = on_reload

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the captured signal after shutting down, so the process dies
        # "by SIGTERM"; a graceful stop should exit 0, so we only install the handlers.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        if self._on_reload is not None:
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, self.handle_reload)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_reload(self, sig, frame) -> None:
        try:
            self._on_reload()
        except Exception:  # a signal handler must not raise into the event loop
            log.exception("SIGHUP: reload failed; keeping the previous keys")

    def handle_exit(self, sig, frame) -> None:
        if self._timer is None:
            self._engine.draining = True
            cutoff = max(self._grace - 0.5, 0.0)
            self._timer = threading.Timer(
                cutoff, self._engine.fail_inflight,
                args=(EngineDeadError("the server is shutting down"),))
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)


def serve_app(app, engine: AsyncEngine, *, host: str, port: int, grace_period: float = 10.0,
              log_level: str = "info", on_reload: Callable[[], object] | None = None) -> int:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=grace_period, lifespan="on",
                            timeout_keep_alive=30)
    redact_access_log()  # after uvicorn.Config, which (re)configures its loggers
    server = _GracefulServer(config, engine, grace_period, on_reload)
    server.run()
    return 0
