"""``llmctl serve --otlp-traces-endpoint``: spans reach a local OTLP/HTTP receiver (decoded
with the OTLP protobuf schema), the last batch at shutdown; bad endpoints are usage errors;
the hand-offs pass the flag to vLLM and refuse it for TensorRT-LLM."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from typer.testing import CliRunner

from llmctl.cli.app import build_app
from llmctl.errors import UsageError
from llmctl.serve.api.tracing import otlp_traces_url
from tests.serve.api.conftest import free_port
from tests.serve.api.test_shutdown import _wait_healthy

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class OtlpReceiver:
    """A collector's OTLP/HTTP traces endpoint on 127.0.0.1: keeps every POST."""

    def __init__(self) -> None:
        posts = self.posts = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                posts.append((self.path, self.headers["Content-Type"], body))
                self.send_response(200)  # an empty ExportTraceServiceResponse
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list:
        """Every span received, decoded, with its resource and scope."""
        pytest.importorskip("opentelemetry.proto")
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        out = []
        for _, _, body in self.posts:
            request = ExportTraceServiceRequest.FromString(body)
            for rs in request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    out.extend((resource, ss.scope.name, span) for span in ss.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    sink = OtlpReceiver()
    yield sink
    sink.close()


@contextlib.contextmanager
def _serve(model, endpoint: str, **env):
    import os

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmctl", "serve", str(model), "--port", str(port),
         "--kv-cache-memory", "64MiB", "--log-level", "warning",
         "--otlp-traces-endpoint", endpoint],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", proc)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_spans_reach_the_receiver_and_the_last_batch_leaves_at_shutdown(tiny_llama, receiver):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    # A batch delay far beyond the test: nothing leaves until the server shuts down, so
    # the spans' arrival is the shutdown's flush (the path the endpoint gets: /v1/traces).
    with _serve(tiny_llama, receiver.url, OTEL_BSP_SCHEDULE_DELAY="600000") as (url, proc):
        resp = httpx.post(url + "/v1/completions", timeout=60,
                          json={"prompt": "The file object", "max_tokens": 5,
                                "ignore_eos": True},
                          headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        assert resp.status_code == 200
        time.sleep(0.5)
        assert receiver.posts == []  # batched, not sent per request
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    assert {(path, ctype) for path, ctype, _ in receiver.posts} == \
        {("/v1/traces", "application/x-protobuf")}
    spans = receiver.spans()
    by_name = {span.name: (resource, scope, span) for resource, scope, span in spans}
    assert sorted(by_name) == ["decode", "llm_request", "prefill", "prefill_chunk", "queue"]
    resource, scope, root = by_name["llm_request"]
    assert resource["service.name"] == "llmctl" and scope == "llmctl.serve"
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == PARENT_ID
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 5
    assert attrs["gen_ai.usage.prompt_tokens"].int_value == resp.json()["usage"]["prompt_tokens"]
    for name in ("queue", "prefill", "decode"):
        child = by_name[name][2]
        assert child.trace_id == root.trace_id and child.parent_span_id == root.span_id
    assert by_name["prefill_chunk"][2].parent_span_id == by_name["prefill"][2].span_id


def test_with_a_short_batch_delay_spans_arrive_while_serving(tiny_llama, receiver):
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    with _serve(tiny_llama, receiver.url + "/v1/traces",
                OTEL_BSP_SCHEDULE_DELAY="50") as (url, _):
        for _ in range(3):
            assert httpx.post(url + "/v1/completions", timeout=60,
                              json={"prompt": "x", "max_tokens": 2}).status_code == 200
        deadline = time.monotonic() + 10
        while sum(s.name == "llm_request" for _, _, s in receiver.spans()) < 3:
            assert time.monotonic() < deadline, receiver.posts
            time.sleep(0.05)


@pytest.mark.parametrize("endpoint,expected", [
    ("http://collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://otel.example/custom/path", "https://otel.example/custom/path"),
])
def test_endpoint_url_gets_the_otlp_traces_path_when_it_has_none(endpoint, expected):
    assert otlp_traces_url(endpoint) == expected


@pytest.mark.parametrize("endpoint", ["grpc://localhost:4317", "http://localhost:4317",
                                      "localhost:4318", "http:///v1/traces",
                                      "http://collector:port/v1/traces"])
def test_endpoints_llmctl_cannot_send_to_are_refused(endpoint):
    with pytest.raises(UsageError):
        otlp_traces_url(endpoint)


runner = CliRunner()


def test_cli_refuses_a_grpc_endpoint_before_loading_anything():
    result = runner.invoke(build_app(), ["serve", "no-such-model", "--otlp-traces-endpoint",
                                         "http://localhost:4317"])
    assert result.exit_code == 2, result.output
    assert "--otlp-traces-endpoint" in result.output and "4318" in result.output
    assert "Traceback" not in result.output


def test_handoffs_pass_the_flag_to_vllm_and_refuse_it_for_trtllm(tiny_llama, tmp_path,
                                                                  monkeypatch):
    from llmctl.serve.handoff import engines as handoff

    commands = []
    monkeypatch.setattr(handoff, "run_handoff", lambda cmd: commands.append(cmd) or 0)
    python = tmp_path / "python"
    python.write_text("")
    endpoint = "http://127.0.0.1:4318/v1/traces"
    app = build_app()
    result = runner.invoke(app, ["serve", str(tiny_llama), "--engine", "vllm",
                                 "--engine-python", str(python),
                                 "--otlp-traces-endpoint", endpoint])
    assert result.exit_code == 0, result.output
    [cmd] = commands
    assert cmd[cmd.index("--otlp-traces-endpoint") + 1] == endpoint
    result = runner.invoke(app, ["serve", str(tiny_llama), "--engine", "trtllm",
                                 "--otlp-traces-endpoint", endpoint])
    assert result.exit_code == 2 and "--otlp-traces-endpoint" in result.output


def test_without_the_flag_the_sdk_is_never_imported():
    code = ("import sys\n"
            "from llmctl.serve.api import app\n"
            "from llmctl.serve.launch import assemble, startup\n"
            "from llmctl.cli import serve\n"
            "print([m for m in sys.modules if m.startswith(('opentelemetry.sdk', "
            "'opentelemetry.exporter', 'llmctl.serve.api.tracing'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
    from llmctl.serve.launch.assemble import ServeOptions
    from llmctl.serve.launch.startup import ServeSettings

    assert ServeSettings(model="m").otlp_traces_endpoint is None  # off by default
    # the one settings object flows down: the launch options hold it, not a copy
    assert ServeOptions(ServeSettings(model="m")).settings.otlp_traces_endpoint is None
