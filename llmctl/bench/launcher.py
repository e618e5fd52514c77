"""Start a server for the run (``llmctl bench`` without ``--target``) and stop it after.

The default command is ``python -m llmctl serve MODEL --host 127.0.0.1 --port P``;
``--server-command`` replaces it with any command line (``{port}`` and ``{model}`` are
filled in), e.g. to benchmark vLLM or llama.cpp's server the same way. Readiness is
``GET /health`` answering 200; a server that exits first is reported with the last
lines it printed.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmctl.errors import LlmctlError, ResourceError


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(model: str, port: int, template: str | None = None,
                   serve_args: str | None = None) -> list[str]:
    if template:
        return [part.format(port=port, model=model) for part in shlex.split(template)]
    return [sys.executable, "-m", "llmctl", "serve", model, "--host", "127.0.0.1",
            "--port", str(port), *shlex.split(serve_args or "")]


def _tail(path: Path, lines: int = 6) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in kept if line.lower().startswith("error")]
    return " | ".join(errors[-2:] or kept[-lines:])


class LaunchedServer:
    """A server subprocess, healthy between ``__enter__`` and ``__exit__``."""

    def __init__(self, command: list[str], base_url: str, *, timeout: float = 600.0,
                 health_path: str = "/health", log_path: Path | None = None) -> None:
        self.command = command
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.health_path = health_path
        self.process: subprocess.Popen | None = None
        # A log the caller names is kept; without one, a temporary file goes at the end.
        self.log_path: Path | None = log_path
        self._keep_log = log_path is not None
        self.startup_seconds: float | None = None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> LaunchedServer:
        import httpx

        if self.log_path is None:
            handle, name = tempfile.mkstemp(prefix="llmctl-bench-server-", suffix=".log")
            self.log_path = Path(name)
            log = os.fdopen(handle, "w")
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = self.log_path.open("w")
        try:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            log.close()
            raise LlmctlError(f"cannot start the server: {exc}",
                              "check --server-command, or pass --target URL") from None
        log.close()
        start = time.perf_counter()
        url = self.base_url + self.health_path
        while True:
            code = self.process.poll()
            if code is not None:
                raise LlmctlError(
                    f"the server exited with code {code} before it was ready: "
                    f"{_tail(self.log_path)}",
                    f"run `{shlex.join(self.command)}` by hand to see why, or pass --target URL "
                    "of a running server")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > self.timeout:
                self.stop()
                raise ResourceError(f"the server was not healthy after {self.timeout:.0f} s "
                                    f"({url}): {_tail(self.log_path)}",
                                    "raise --server-timeout or check the server log")
            time.sleep(0.2)
        self.startup_seconds = time.perf_counter() - start
        return self

    def stop(self, grace: float = 15.0) -> int | None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        try:
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: children go too
        except ProcessLookupError:
            pass
        try:
            return proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(5)

    def __exit__(self, *exc) -> None:
        self.stop()
        if self.log_path is not None and not self._keep_log:
            self.log_path.unlink(missing_ok=True)
