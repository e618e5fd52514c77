"""A real llmctl server on 127.0.0.1 (in-process thread) over the tiny model."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Running:
    url: str
    server: object  # llmctl.serve.api.handler.RequestHandler
    engine: object  # AsyncEngine
    uvicorn: object

    def stop(self) -> None:
        self.uvicorn.should_exit = True


def start_server(model: str, *, api_key=None, max_queue=256, request_timeout=None,
                 served_model_name="tiny", auth_file=None, engine_process=False,
                 supervision=None, lora_runtime_updates=False, max_request_bytes=None,
                 metrics_public=False, allow_special_tokens_in_content=False,
                 **engine_kwargs) -> Running:
    """In-process engine by default: tests reach into it (EngineGate). With
    ``engine_process`` the engine runs in supervised processes (llmctl.serve.proc)."""
    import uvicorn

    from llmctl.serve.api.app import create_app
    from llmctl.serve.launch.assemble import ServeOptions, build_server
    from llmctl.serve.launch.startup import ServeSettings

    kwargs = dict(kv_cache_memory="64MiB", max_num_seqs=32, max_num_batched_tokens=256)
    kwargs.update(engine_kwargs)
    settings = ServeSettings(
        model=model, served_model_name=served_model_name, api_key=api_key,
        auth_file=None if auth_file is None else str(auth_file), max_queue=max_queue,
        request_timeout=request_timeout, engine_process=engine_process,
        enable_lora_runtime_updates=lora_runtime_updates, metrics_public=metrics_public,
        allow_special_tokens_in_content=allow_special_tokens_in_content)
    opts = ServeOptions(settings, engine_kwargs=kwargs, supervision=supervision,
                        max_request_bytes=max_request_bytes)
    server, engine = build_server(opts)
    engine.start()
    port = free_port()
    app = create_app(server, on_shutdown=engine.shutdown)
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            lifespan="on")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    else:
        raise RuntimeError("server did not come up")
    return Running(url, server, engine, uv)


class EngineGate:
    """Makes "in flight" certain rather than a matter of timing: the engine thread waits
    at its next step until ``count`` requests are submitted, admits them in that one step
    and then holds until :meth:`remove`."""

    def __init__(self, running: Running, count: int) -> None:
        self.engine = running.engine.engine
        self.count = count
        self.held = threading.Event()
        self.go = threading.Event()
        real = self.engine.step

        def step():
            deadline = time.monotonic() + 120
            while not self.held.is_set() and running.engine.num_streams < count and \
                    time.monotonic() < deadline:
                time.sleep(0.005)
            outputs = real()
            if not self.held.is_set() and len(self.engine.requests) >= count:
                self.held.set()
                self.go.wait(120)
            return outputs

        self.engine.step = step

    def wait(self) -> None:
        assert self.held.wait(120), "the requests never reached the engine"

    def remove(self) -> None:
        self.go.set()
        del self.engine.step  # back to the class's method


@pytest.fixture(scope="module")
def served(tiny_llama):
    running = start_server(str(tiny_llama))
    yield running
    running.stop()
