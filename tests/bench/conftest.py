"""Fixtures for ``llmctl bench`` tests: the fake OpenAI-compatible server."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

FAKE_SERVER = Path(__file__).with_name("fake_server.py")


@contextlib.contextmanager
def fake_server(*args: str):
    """Start ``fake_server.py`` on a free port; yield ``(base_url, process)``."""
    proc = subprocess.Popen([sys.executable, str(FAKE_SERVER), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT "):
            proc.kill()
            raise RuntimeError(f"fake server did not start: {line!r} {proc.stderr.read()}")
        yield f"http://127.0.0.1:{int(line.split()[1])}", proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()
        proc.stderr.close()


@pytest.fixture(scope="module")
def server():
    """A well-behaved fake server shared by a test module: 10 ms TTFT, 2 ms ITL."""
    with fake_server("--ttft-ms", "10", "--itl-ms", "2") as (url, _):
        yield url
