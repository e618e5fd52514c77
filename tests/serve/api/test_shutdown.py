"""``llmctl serve`` as a process: SIGTERM with requests in flight, and the hand-off."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from llmctl.serve.handoff.engines import HandoffOptions, run_handoff, trtllm_command, vllm_command
from tests.serve.api.conftest import free_port


def _wait_healthy(url, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not start")


async def _stream(url, body):
    """'done' if the stream ended with [DONE], 'error' if with an error event."""
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            last = None
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    last = line[6:]
            if last == "[DONE]":
                return "done"
            if last is not None and "error" in json.loads(last):
                return "error"
            return f"cut: {last}"


def test_sigterm_finishes_or_errors_every_stream_and_exits_0(tiny_llama):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmctl", "serve", str(tiny_llama), "--port", str(port),
         "--grace-period", "1", "--kv-cache-memory", "64MiB", "--max-num-seqs", "1",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_healthy(url, proc)

        async def scenario():
            # One sequence at a time: the first is generating at SIGTERM, the others wait
            # in the queue, and the last cannot finish within the grace period: 16 x 480
            # tokens in 1 s would take 0.13 ms a token (4 x 480 in 3 s, as this test had
            # it, became reachable once the engine's decode step got faster).
            long = {"prompt": "a", "max_tokens": 480, "ignore_eos": True, "stream": True}
            tasks = [asyncio.create_task(_stream(url, long)) for _ in range(16)]
            # SIGTERM only once the long requests are generating
            async with httpx.AsyncClient() as client:
                for _ in range(600):
                    metrics = (await client.get(url + "/metrics")).text
                    if _gauge(metrics, "running") + _gauge(metrics, "waiting") >= len(tasks):
                        break
                    await asyncio.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

        outcomes = asyncio.run(scenario())
        assert set(outcomes) <= {"done", "error"}, outcomes
        assert outcomes[-1] == "error"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def _gauge(metrics: str, kind: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f"llmctl:num_requests_{kind}{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _opts(**kw):
    from pathlib import Path

    base = dict(model_path=Path("/models/m"), served_name="m", host="127.0.0.1", port=9000)
    return HandoffOptions(**{**base, **kw})


def test_vllm_command_line(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text("")
    cmd = vllm_command(_opts(python=str(fake_python), api_key="k", max_model_len=2048,
                             dtype="bfloat16", tensor_parallel_size=2))
    assert cmd[:3] == [str(fake_python), "-m", "vllm.entrypoints.openai.api_server"]
    args = dict(zip(cmd[3::2], cmd[4::2]))
    assert args == {"--model": "/models/m", "--served-model-name": "m", "--host": "127.0.0.1",
                    "--port": "9000", "--api-key": "k", "--max-model-len": "2048",
                    "--dtype": "bfloat16", "--tensor-parallel-size": "2"}


def test_missing_engines_say_what_to_install(monkeypatch):
    from llmctl.errors import MissingDependencyError

    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(MissingDependencyError, match="vllm"):
        vllm_command(_opts())
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(MissingDependencyError, match="trtllm-serve"):
        trtllm_command(_opts())


def test_handoff_forwards_sigterm_and_returns_the_exit_code(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(7))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")
    import threading

    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        assert run_handoff([sys.executable, str(script)]) == 7
    finally:
        timer.cancel()


def test_cli_handoff_without_vllm_is_a_clear_error(tiny_llama, monkeypatch):
    from typer.testing import CliRunner

    from llmctl.cli.app import build_app

    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    result = CliRunner().invoke(build_app(), ["serve", str(tiny_llama), "--engine", "vllm"])
    assert result.exit_code == 1
    assert "vllm package is not installed" in result.output
    result = CliRunner().invoke(build_app(), ["serve", str(tiny_llama), "--engine", "tgi"])
    assert result.exit_code == 2 and "unknown engine" in result.output
